# shellcheck shell=bash
# PostgreSQL for the gateway's store tests: a private, throw-away cluster. Sourced by
# scripts/services.sh (which `make test` runs), so this file only defines functions.
#
# tp_postgres_start, idempotently:
#   1. uses $TOKENPATH_TEST_POSTGRES_URL as is when it is already set (a server you run yourself);
#   2. otherwise installs Debian's `postgresql` with apt when no server binaries are present and
#      this is root (as on a fresh CI machine);
#   3. runs a cluster in a fresh directory ($TOKENPATH_TEST_PG_DIR, default a mktemp dir) as a
#      non-root user, on 127.0.0.1 only, on a free port (never 5432), with the Unix socket inside that
#      directory: it touches no system cluster, and two checkouts testing at once do not collide;
#   4. creates the database `tokenpath_test` and exports TOKENPATH_TEST_POSTGRES_URL.
# It returns 0 only when it started a cluster (which tp_postgres_stop then stops and deletes), and
# otherwise prints why the PostgreSQL tests will be skipped; pytest -ra lists them with that reason.

_tp_pg_log() { echo "[postgres] $*" >&2; }

_tp_pg_bindir() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return 0; fi
  done
  if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
    dirname "$(command -v initdb)"; return 0
  fi
  return 1
}

_tp_pg_install() {
  if _tp_pg_bindir >/dev/null; then return 0; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    _tp_pg_log "PostgreSQL is not installed, and installing it needs root and apt-get" \
      "(e.g. sudo apt-get install postgresql)"
    return 1
  fi
  _tp_pg_log "installing Debian's postgresql with apt"
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null &&
    _tp_pg_bindir >/dev/null
}

# Runs a command as the cluster's owner: initdb and postgres refuse to run as root.
_tp_pg_as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

_tp_pg_free_port() {
  local py
  py=$(command -v python3 || command -v python) || return 1
  "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

tp_postgres_start() {
  if [ -n "${TOKENPATH_TEST_POSTGRES_URL:-}" ]; then
    _tp_pg_log "using TOKENPATH_TEST_POSTGRES_URL from the environment"
    return 1
  fi
  _tp_pg_install || { _tp_pg_log "WARNING: no PostgreSQL server; the PostgreSQL store tests will be skipped"; return 1; }
  local bin dir port
  bin=$(_tp_pg_bindir) || return 1
  if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres || return 1
  fi
  dir=${TOKENPATH_TEST_PG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/tokenpath-test-pg.XXXXXX")} || return 1
  mkdir -p "$dir" && chmod 700 "$dir" || return 1
  if [ "$(id -u)" = 0 ]; then chown postgres: "$dir"; fi
  _TP_PG_DIR=$dir _TP_PG_BIN=$bin
  _tp_pg_as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-locale \
    >"$dir/initdb.log" 2>&1 || { _tp_pg_log "initdb failed: see $dir/initdb.log"; return 1; }
  port=$(_tp_pg_free_port) || return 1
  [ "$port" = 5432 ] && port=$(_tp_pg_free_port)
  _tp_pg_as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off" >/dev/null ||
    { _tp_pg_log "the server did not start: see $dir/server.log"; return 1; }
  _tp_pg_as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres tokenpath_test || return 1
  export TOKENPATH_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$port/tokenpath_test"
  _tp_pg_log "started a private cluster on 127.0.0.1:$port ($dir)"
}

tp_postgres_stop() {
  [ -n "${_TP_PG_DIR:-}" ] || return 0
  _tp_pg_as_owner "$_TP_PG_BIN/pg_ctl" -D "$_TP_PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
  rm -rf "$_TP_PG_DIR"
  _tp_pg_log "stopped and removed the private cluster"
  unset _TP_PG_DIR
}
