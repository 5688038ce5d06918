#!/usr/bin/env bash
# Claude Code (the real client, from npm) against `mlxserve serve` on a scripted checkpoint.
#
# The checkpoint's first script calls Claude Code's `Read` tool on a file made here; the
# second answers in text. Passes when Claude Code ran the tool, sent its result back, and
# printed the scripted answer. Loopback only; run by `make e2e-clients`, not by CI.
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

"$BIN/mlxserve" serve "$WORK/ckpt" --port "$PORT" >"$WORK/server.log" 2>&1 &
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
