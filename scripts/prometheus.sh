# shellcheck shell=bash
# Debian's Prometheus (and promtool) for the metrics tests, as a scripts/services.sh service
# (`make test`): tp_prometheus_start installs it when missing (root + apt) and starts nothing (each
# test runs its own Prometheus against the server it started, on a free loopback port), so it
# returns 1 (nothing to stop). When it cannot install, the Prometheus tests skip, naming what is missing.

_tp_prometheus_log() { echo "[prometheus.sh] $*" >&2; }

tp_prometheus_start() {
  if command -v prometheus >/dev/null && command -v promtool >/dev/null; then return 1; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    _tp_prometheus_log "prometheus is missing and apt-get is not usable here; the Prometheus tests will skip"
    return 1
  fi
  _tp_prometheus_log "installing Debian's prometheus with apt"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
         DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
           --no-install-recommends prometheus >/dev/null; }; then
    _tp_prometheus_log "apt-get install prometheus failed; the Prometheus tests will skip"
  fi
  # Debian's package starts a system Prometheus on :9090; the tests run their own.
  if command -v systemctl >/dev/null; then systemctl stop prometheus >/dev/null 2>&1 || true; fi
  if command -v service >/dev/null; then service prometheus stop >/dev/null 2>&1 || true; fi
  return 1
}

tp_prometheus_stop() { :; }
