#!/usr/bin/env bash
# Claude Code (the real client, from npm) against `mlxserve serve` on a scripted checkpoint.
#
# Two models in one server, as the README sets Claude Code up: a scripted DeepSeek-V4 as the
# main model (`claude-opus`) and a tiny Qwen3 as the small fast model (`claude-haiku`). The
# checkpoint's first script calls Claude Code's `Read` tool on a file made here; the second
# answers in text. Passes when Claude Code ran the tool, sent its result back, printed the
# scripted answer, and its background requests reached the small model (per-model /metrics).
# Loopback only; run by `make e2e-clients`, not by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-.venv/bin}"
PORT="${PORT:-8765}"
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

echo "installing @anthropic-ai/claude-code into $WORK/npm ..."
npm install --prefix "$WORK/npm" --silent --no-audit --no-fund @anthropic-ai/claude-code >/dev/null
CLAUDE="$WORK/npm/node_modules/.bin/claude"
"$CLAUDE" --version

echo "the secret word is mlxserve-e2e" >"$WORK/hello.txt"
"$BIN/mlxserve" make-model "$WORK/ckpt" --family scripted \
    --script "I will read the file.</think>

<｜DSML｜tool_calls>
<｜DSML｜invoke name=\"Read\">
<｜DSML｜parameter name=\"file_path\" string=\"true\">$WORK/hello.txt</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>" \
    --script "I have the file.</think>The file says the secret word is mlxserve-e2e."

"$BIN/mlxserve" make-model "$WORK/small" --family qwen3 >/dev/null

"$BIN/mlxserve" serve --model "scripted-v4,claude-opus=$WORK/ckpt" \
    --model "small,claude-haiku=$WORK/small" --port "$PORT" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 120); do
    if curl -fs "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    sleep 0.5
done
curl -fs "http://127.0.0.1:$PORT/health"
echo

mkdir -p "$WORK/home"
(
    cd "$WORK"
    HOME="$WORK/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=x \
        ANTHROPIC_MODEL=claude-opus ANTHROPIC_SMALL_FAST_MODEL=claude-haiku \
        ANTHROPIC_DEFAULT_HAIKU_MODEL=claude-haiku \
        DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
        timeout 300 "$CLAUDE" -p "Read hello.txt and tell me the secret word" --max-turns 3 \
        --output-format stream-json --verbose >"$WORK/transcript.jsonl"
)

"$BIN/python" - "$WORK/transcript.jsonl" <<'EOF'
import json
import sys

events = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8") if line.strip()]
blocks = [
    (event["type"], block)
    for event in events
    if event.get("type") in ("assistant", "user")
    for block in event["message"]["content"]
    if isinstance(block, dict)
]
calls = [b for kind, b in blocks if kind == "assistant" and b.get("type") == "tool_use"]
results = [b for kind, b in blocks if kind == "user" and b.get("type") == "tool_result"]
final = next(event for event in events if event.get("type") == "result")
assert calls and calls[0]["name"] == "Read", calls
assert results and "mlxserve-e2e" in json.dumps(results[0]), results
assert final["result"] == "The file says the secret word is mlxserve-e2e.", final
print("claude code e2e: ok (Read ran, its result went back, the answer printed)")
EOF
curl -fs "http://127.0.0.1:$PORT/v1/cache/stats"
echo
METRICS="$(curl -fs "http://127.0.0.1:$PORT/metrics")"
grep -E '^mlxserve_requests_total\{' <<<"$METRICS"
# Requests to a model with this outcome (a regex): Claude Code may abort its background
# requests (a title, say) once its turn is over, so those count whatever their outcome.
per_model() {
    grep -E "^mlxserve_requests_total\{endpoint=\"messages\",model_name=\"$1\",outcome=\"$2\"\}" \
        <<<"$METRICS" | awk '{s += $2} END {printf "%d", s}'
}
big="$(per_model scripted-v4 ok)"
small="$(per_model small '[a-z0-9]+')"
echo "messages served: scripted-v4=$big small=$small"
[ "$big" -ge 2 ] || { echo "the main model served $big requests (want >= 2)"; exit 1; }
[ "$small" -ge 1 ] || { echo "no background request reached the small model"; exit 1; }
echo "claude code e2e: ok (background requests went to the small fast model)"
