# Re-captures the README's `tokenpath trace` / `diagnose` example: serve --max-num-seqs 1 with
# SmolLM2, three warm-up requests, then a 4-token request sent while a 96-token one runs. Run it on
# a quiet machine and paste its output into the README.
set -e
cd "$(dirname "$0")/.."
D=$(mktemp -d); PORT=$(.venv/bin/python -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
.venv/bin/tokenpath serve --port $PORT --max-num-seqs 1 --data-dir $D > $D/serve.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
U=http://127.0.0.1:$PORT/v1/chat/completions
for i in 0 1 2; do curl -s $U -H 'content-type: application/json' -H "x-request-id: req-warm-$i" -d '{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"Hello there, how are you?"}],"max_tokens":8}' >/dev/null; done
curl -s $U -H 'content-type: application/json' -H 'x-request-id: req-long-report' -d '{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"Write a long report about the sea."}],"max_tokens":96,"ignore_eos":true}' >/dev/null &
sleep 0.3
curl -s $U -H 'content-type: application/json' -H 'x-request-id: req-short-hello' -d '{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"Hello there, how are you?"}],"max_tokens":4,"ignore_eos":true}' >/dev/null
wait %2 2>/dev/null || true
sleep 1
echo '$ tokenpath trace req-short-hello'
TOKENPATH_DATA_DIR=$D .venv/bin/tokenpath trace req-short-hello
echo
echo "\$ tokenpath diagnose --since 10m --url http://127.0.0.1:8000"
TOKENPATH_DATA_DIR=$D .venv/bin/tokenpath diagnose --since 10m --url http://127.0.0.1:$PORT
kill $SP; wait $SP || true
