# shellcheck shell=bash
# Debian's Chromium for the dashboard's browser test (issue 12), as a scripts/services.sh service
# (`make test`): tp_chromium_start installs it when missing (root + apt) and starts nothing, so it
# returns 1 (nothing to stop); when it cannot install, the browser test skips, naming
# /usr/bin/chromium as missing.
#
# Playwright for Python (a test dependency in pyproject.toml, installed by `make install`) drives
# this binary through `executable_path="/usr/bin/chromium"`; nothing downloads a browser, and
# PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 makes sure of it.

_tp_chromium_log() { echo "[chromium.sh] $*" >&2; }

_tp_chromium_install() {
  export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
  if [ -x /usr/bin/chromium ]; then return 0; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    _tp_chromium_log "/usr/bin/chromium is missing and apt-get is not usable here; the dashboard browser test will skip"
    return 0
  fi
  _tp_chromium_log "installing Debian's chromium with apt"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }; then
    _tp_chromium_log "apt-get install chromium failed; the dashboard browser test will skip"
  fi
  return 0
}

tp_chromium_start() {
  _tp_chromium_install
  return 1
}

tp_chromium_stop() { :; }
