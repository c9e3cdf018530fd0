#!/usr/bin/env bash
# shellcheck shell=bash
# Redis for gateways that share rate limits (`tokenpath serve --redis-url`), on loopback only.
#
#   scripts/redis.sh start    install Debian's redis-server if missing (root + apt), start one
#                             bound to 127.0.0.1 on a free port in a private dir, print its URL
#   scripts/redis.sh stop     stop it (nothing is kept: there is no persistence to keep)
#   scripts/redis.sh url      print the URL of the running one
#   source scripts/redis.sh   defines tp_redis_start/tp_redis_stop for scripts/services.sh (`make test`):
#                             start one, export TOKENPATH_TEST_REDIS_URL; when none can be had, say
#                             why (the Redis tests skip with that reason)
#
# TOKENPATH_REDIS_DIR: the private dir (default $TMPDIR/tokenpath-redis): pid, port, log.
# TOKENPATH_REDIS_PORT: a fixed port instead of a free one (tests restart Redis on the same port).
# Limits are windows of a minute and counters of a day: losing them on a restart costs at most
# that much accuracy, so the server runs with no RDB snapshots and no AOF (`--save '' --appendonly no`).

_tp_redis_log() { echo "[redis.sh] $*" >&2; }

_tp_redis_dir() { echo "${TOKENPATH_REDIS_DIR:-${TMPDIR:-/tmp}/tokenpath-redis}"; }

_tp_redis_install() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then return 0; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    _tp_redis_log "redis-server is not installed and apt-get is not usable here (apt-get install redis-server)"
    return 1
  fi
  _tp_redis_log "installing Debian's redis-server with apt"
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends \
      redis-server >/dev/null &&
    command -v redis-server >/dev/null
}

_tp_redis_free_port() {
  local py
  py=$(command -v python3 || command -v python) || return 1
  "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

_tp_redis_running() {  # the server recorded in the dir answers PING
  local dir
  dir=$(_tp_redis_dir)
  [ -f "$dir/port" ] && [ -f "$dir/redis.pid" ] && kill -0 "$(cat "$dir/redis.pid")" 2>/dev/null &&
    [ "$(redis-cli -h 127.0.0.1 -p "$(cat "$dir/port")" ping 2>/dev/null)" = PONG ]
}

_tp_redis_url() { echo "redis://127.0.0.1:$(cat "$(_tp_redis_dir)/port")/0"; }

_tp_redis_start() {
  local dir port i
  _tp_redis_install || return 1
  dir=$(_tp_redis_dir)
  mkdir -p "$dir" && chmod 700 "$dir" || return 1
  if _tp_redis_running; then
    _tp_redis_log "reusing the server in $dir on port $(cat "$dir/port")"
    return 0
  fi
  port=${TOKENPATH_REDIS_PORT:-$(_tp_redis_free_port)} || return 1
  redis-server --bind 127.0.0.1 --port "$port" --protected-mode yes --dir "$dir" \
    --save '' --appendonly no --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" \
    >/dev/null || { _tp_redis_log "redis-server did not start: see $dir/redis.log"; return 1; }
  echo "$port" >"$dir/port"
  for i in $(seq 1 100); do
    if _tp_redis_running; then
      _tp_redis_log "started redis-server in $dir on 127.0.0.1:$port"
      return 0
    fi
    sleep 0.1
  done
  _tp_redis_log "redis-server did not answer on port $port: see $dir/redis.log"
  return 1
}

_tp_redis_stop() {
  local dir pid i
  dir=$(_tp_redis_dir)
  [ -f "$dir/redis.pid" ] || { _tp_redis_log "no server recorded in $dir"; return 0; }
  pid=$(cat "$dir/redis.pid")
  if kill "$pid" 2>/dev/null; then
    for i in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  fi
  rm -f "$dir/redis.pid"
  _tp_redis_log "stopped the server in $dir"
}

# The scripts/services.sh interface (what `make test` uses): start one unless a URL is given,
# export TOKENPATH_TEST_REDIS_URL, and return 0 only when this started something to stop.
tp_redis_start() {
  if [ -n "${TOKENPATH_TEST_REDIS_URL:-}" ]; then
    _tp_redis_log "using TOKENPATH_TEST_REDIS_URL from the environment"
    return 1
  fi
  if _tp_redis_start; then
    TOKENPATH_TEST_REDIS_URL=$(_tp_redis_url)
    export TOKENPATH_TEST_REDIS_URL
    _tp_redis_log "TOKENPATH_TEST_REDIS_URL=$TOKENPATH_TEST_REDIS_URL"
    return 0
  fi
  _tp_redis_log "WARNING: no Redis server; the Redis limit tests will be skipped"
  return 1
}

tp_redis_stop() { _tp_redis_stop; }

if [ "${BASH_SOURCE[0]}" != "$0" ]; then  # sourced (by scripts/services.sh): define, start nothing
  true
else
  set -euo pipefail
  case "${1:-}" in
    start) _tp_redis_start && _tp_redis_url ;;
    stop) _tp_redis_stop ;;
    url) if _tp_redis_running; then _tp_redis_url; else _tp_redis_log "not running (dir $(_tp_redis_dir))"; exit 1; fi ;;
    *) echo "usage: $0 start|stop|url   (dir: \$TOKENPATH_REDIS_DIR, port: \$TOKENPATH_REDIS_PORT)" >&2; exit 2 ;;
  esac
fi
