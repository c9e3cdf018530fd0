#!/usr/bin/env bash
# Runs a command with the test services up: `scripts/services.sh CMD...` (what `make test` does).
#
# Each service NAME in $TOKENPATH_TEST_SERVICES (default: "postgres redis chromium") is a file scripts/NAME.sh that
# defines tp_NAME_start (export the URL the tests read; return 0 only if it started something) and
# tp_NAME_stop. A service that cannot start says why, and its tests FAIL (tests/capabilities.py)
# unless the run allows it: TOKENPATH_TEST_ALLOW_MISSING=NAME;
# the ones that started are stopped when the command ends, however it ends. To add one (Redis, a
# browser), drop in scripts/NAME.sh and add NAME to the default list below.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
read -r -a services <<<"${TOKENPATH_TEST_SERVICES:-postgres redis chromium prometheus}"
started=()

stop_started() {
  local s
  for s in "${started[@]}"; do "tp_${s}_stop" || true; done
  started=()
}
trap stop_started EXIT
trap 'exit 130' INT TERM

for s in "${services[@]}"; do
  # shellcheck source=/dev/null
  source "$here/$s.sh"
  if "tp_${s}_start"; then started+=("$s"); fi
done

"$@"
