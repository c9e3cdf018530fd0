#!/usr/bin/env bash
# Installs the load generators that benchmarks/load_generators.py drives (guidellm 0.8.1, aiperf
# 0.13.0) into a venv of their own, .cache/loadgen-venv (gitignored). Installed into the project
# venv they would change its versions of prometheus-client, rich, pillow, huggingface-hub and
# others; here the project venv's packages are visible through a .pth line, and pip adds only what
# the two tools need on top. torch stays the project venv's
# CPU build (2.13.0, named so that pip never resolves another).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VENV=.cache/loadgen-venv
"$PY" -m venv "$VENV"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
OWN=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$SITE" > "$OWN/project-venv.pth"
"$VENV/bin/python" -m pip install -q "guidellm==0.8.1" "aiperf==0.13.0" "torch==2.13.0"
"$VENV/bin/guidellm" --help >/dev/null && "$VENV/bin/aiperf" --help >/dev/null && echo "$VENV: guidellm and aiperf installed"
