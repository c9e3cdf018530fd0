# shellcheck shell=bash
# PostgreSQL for the gateway's store tests (issue 4). Sourced by .ci/run (which runs under
# `set -euo pipefail`), so this file only defines functions, never calls `exit`, and returns 0
# when it cannot provide a server: the PostgreSQL tests are then skipped, with the reason shown.
#
# What it does, idempotently:
#   1. installs Debian's `postgresql` with apt when no server binaries are present;
#   2. runs a private cluster in $TOKENPATH_CI_PG_DIR (default: $TMPDIR/tokenpath-ci-pg) as a
#      non-root user, listening on 127.0.0.1 only, on a free port (never the default 5432), with
#      the Unix socket inside that directory (it touches no system cluster);
#   3. creates the database `tokenpath_test` and exports TOKENPATH_TEST_POSTGRES_URL.
# When the cluster is already running (a second `source`), it is reused as is.

_tp_pg_log() { echo "[postgres.sh] $*" >&2; }

_tp_pg_bindir() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return 0; fi
  done
  return 1
}

_tp_pg_install() {
  if _tp_pg_bindir >/dev/null; then return 0; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    _tp_pg_log "PostgreSQL is not installed and apt-get is not usable here"; return 1
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

_tp_pg_start() {
  local bin dir port
  bin=$(_tp_pg_bindir) || return 1
  dir=${TOKENPATH_CI_PG_DIR:-${TMPDIR:-/tmp}/tokenpath-ci-pg}
  if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres || return 1
  fi
  mkdir -p "$dir" || return 1
  [ "$(id -u)" = 0 ] && chown postgres: "$dir"
  chmod 700 "$dir"

  if [ -f "$dir/port" ] && _tp_pg_as_owner "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
    port=$(cat "$dir/port")
    _tp_pg_log "reusing the running cluster in $dir on port $port"
  else
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      _tp_pg_as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-locale \
        >"$dir/initdb.log" 2>&1 || { _tp_pg_log "initdb failed: see $dir/initdb.log"; return 1; }
    fi
    port=$(_tp_pg_free_port) || return 1
    [ "$port" = 5432 ] && port=$(_tp_pg_free_port)
    _tp_pg_as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start \
      -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off" >/dev/null ||
      { _tp_pg_log "the server did not start: see $dir/server.log"; return 1; }
    echo "$port" >"$dir/port"
    _tp_pg_log "started a cluster in $dir on 127.0.0.1:$port"
  fi

  if ! _tp_pg_as_owner "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname = 'tokenpath_test'" | grep -q 1; then
    _tp_pg_as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres tokenpath_test || return 1
  fi
  export TOKENPATH_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$port/tokenpath_test"
}

if _tp_pg_install && _tp_pg_start; then
  _tp_pg_log "TOKENPATH_TEST_POSTGRES_URL=$TOKENPATH_TEST_POSTGRES_URL"
else
  _tp_pg_log "WARNING: no PostgreSQL server; the PostgreSQL store tests will be skipped"
fi
true
