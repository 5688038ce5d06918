#!/usr/bin/env bash
# Claude Code (the real client, from npm) sends a PNG it read to `mlxserve serve`.
#
# One server, three models: the tiny LLaVA with a vision tower (`claude-vision`), a
# scripted DeepSeek-V4 that reads text only (`claude-opus`, served with
# `--images-for-text-models placeholder`) and a tiny Qwen3 for Claude Code's background
# requests (`claude-haiku`). One session, three turns:
#   1. `claude-vision`: "Describe @shot.png"; Claude Code reads the PNG with its Read tool
#      and sends it as an image block; the vision tower reads it and the model answers.
#   2. `claude-opus` (--continue): its script calls Read on shot.png; the tool_result holds
#      the image, which reaches the text-only model as a note; it answers.
#   3. `claude-opus` (--continue): the history, screenshot included, re-sent; it answers.
# Random weights answer gibberish, and never end it: Claude Code reports an answer cut at
# max_tokens as an API error, so the vision checkpoint's config lists every tenth token id
# as an end of sequence (its gibberish ends after a few tokens, as a trained model's answer
# would). Passes when every turn completes without an API error, the vision model's tower
# read the image, and the text-only model got notes in its place.
# Loopback only; run by `make e2e-clients`, not by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-.venv/bin}"
PORT="${PORT:-8766}"
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
    if [ -z "${KEEP:-}" ]; then rm -rf "$WORK"; else echo "kept $WORK"; fi
}
trap cleanup EXIT
fail() {
    echo "claude code images e2e: FAIL: $*" >&2
    tail -40 "$WORK/server.log" >&2 || true
    exit 1
}

echo "installing @anthropic-ai/claude-code into $WORK/npm ..."
npm install --prefix "$WORK/npm" --silent --no-audit --no-fund @anthropic-ai/claude-code >/dev/null
CLAUDE="$WORK/npm/node_modules/.bin/claude"
"$CLAUDE" --version

"$BIN/python" - "$WORK/shot.png" <<'EOF'
import sys

from PIL import Image, ImageDraw

image = Image.new("RGB", (120, 80), (255, 255, 255))
ImageDraw.Draw(image).rectangle((30, 20, 90, 60), fill=(220, 30, 30))
image.save(sys.argv[1])
EOF

# The tiny LLaVA by default; VISION_FAMILY=deepseek_v4 (or deepseek_v41) runs the same
# session on that family's tiny vision checkpoint (Claude Code's long prompt is prefilled
# in budgeted chunks there too, each image whole in one: slower on a CPU, same checks).
"$BIN/mlxserve" make-model "$WORK/vision" --family "${VISION_FAMILY:-llama}" --vision >/dev/null
"$BIN/python" - "$WORK/vision/config.json" <<'EOF'
import json
import sys

path = sys.argv[1]
config = json.load(open(path, encoding="utf-8"))
config["eos_token_id"] = [config["eos_token_id"], *range(10, config["vocab_size"], 10)]
json.dump(config, open(path, "w", encoding="utf-8"))
EOF
READ="<｜DSML｜tool_calls>
<｜DSML｜invoke name=\"Read\">
<｜DSML｜parameter name=\"file_path\" string=\"true\">$WORK/shot.png</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>"
ANSWER="The picture was not shown to me; I know only that it was a PNG."
# The n-th assistant turn of the session gets the n-th script (the last repeats): the
# first is the vision model's, so the second calls Read (and so does the first, should
# Claude Code leave an empty answer out of the history), the rest answer.
"$BIN/mlxserve" make-model "$WORK/ckpt" --family scripted \
    --script "I will read it.</think>

$READ" --script "I will read it.</think>

$READ" --script "I have read it.</think>$ANSWER" >/dev/null
"$BIN/mlxserve" make-model "$WORK/small" --family qwen3 >/dev/null

"$BIN/mlxserve" serve --model "vision,claude-vision=$WORK/vision" \
    --model "scripted-v4,claude-opus=$WORK/ckpt" --model "small,claude-haiku=$WORK/small" \
    --images-for-text-models placeholder --port "$PORT" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 240); do
    if curl -fs "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    sleep 0.5
done
curl -fs "http://127.0.0.1:$PORT/health" || fail "the server did not start"
echo

mkdir -p "$WORK/home"
# turn N MODEL PROMPT [claude options]: one `claude -p` of the session, its events kept.
turn() {
    local n="$1" model="$2" prompt="$3"
    shift 3
    echo "turn $n ($model): $prompt"
    (
        cd "$WORK"
        HOME="$WORK/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=x \
            ANTHROPIC_SMALL_FAST_MODEL=claude-haiku ANTHROPIC_DEFAULT_HAIKU_MODEL=claude-haiku \
            CLAUDE_CODE_MAX_OUTPUT_TOKENS=512 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
            timeout 600 "$CLAUDE" -p "$prompt" --model "$model" --max-turns 4 "$@" \
            --output-format stream-json --verbose >"$WORK/turn$n.jsonl"
    ) || fail "turn $n: claude exited with status $? ($(tail -c 600 "$WORK/turn$n.jsonl"))"
}
turn 1 claude-vision "Describe @shot.png"
turn 2 claude-opus "Read shot.png again, yourself" --continue
turn 3 claude-opus "What did it show?" --continue

"$BIN/python" - "$WORK" "$ANSWER" <<'EOF'
import json
import sys

work, answer = sys.argv[1], sys.argv[2]


def events(n):
    with open(f"{work}/turn{n}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def blocks(evs, kind):
    return [
        block
        for ev in evs
        if ev.get("type") == kind
        for block in ev["message"]["content"]
        if isinstance(block, dict)
    ]


for n in (1, 2, 3):
    evs = events(n)
    final = next(ev for ev in evs if ev.get("type") == "result")
    errors = [ev for ev in evs if ev.get("type") == "assistant" and ev.get("error")]
    assert not final["is_error"] and final["subtype"] == "success" and not errors, (n, final)
    print(f"turn {n}: {final['result'][:80]!r}")
    if n > 1:
        assert final["result"] == answer, (n, final["result"])
calls = [b for b in blocks(events(2), "assistant") if b.get("type") == "tool_use"]
assert calls and all(c["name"] == "Read" for c in calls), calls
results = [b for b in blocks(events(2), "user") if b.get("type") == "tool_result"]
images = [c for r in results for c in r["content"] if isinstance(c, dict)]
assert any(c.get("type") == "image" for c in images), results
print("claude code images e2e: ok (every turn answered, Read's PNG went back as an image)")
EOF

METRICS="$(curl -fs "http://127.0.0.1:$PORT/metrics")"
grep -E '^mlxserve_(requests_total|images_total|vision_seconds_count)\{' <<<"$METRICS"
sample() {  # the sum of a metric's samples whose labels match a regex
    { grep -E "^$1\{[^}]*$2" <<<"$METRICS" || true; } | awk '{s += $2} END {printf "%d", s}'
}
seen="$(sample mlxserve_images_total 'model_name="vision",outcome="accepted"')"
tower="$(sample mlxserve_vision_seconds_count 'model_name="vision"')"
notes="$(sample mlxserve_images_total 'model_name="scripted-v4",outcome="placeholder"')"
failed="$(sample mlxserve_requests_total 'model_name="(vision|scripted-v4)",outcome="(error|[0-9]+)"')"
echo "images: vision accepted=$seen tower=$tower, scripted-v4 notes=$notes; failed requests=$failed"
[ "$seen" -ge 1 ] && [ "$tower" -ge 1 ] || fail "the vision model did not read the image"
[ "$notes" -ge 2 ] || fail "the text-only model got $notes notes (want >= 2)"
[ "$failed" -eq 0 ] || fail "$failed requests failed"
echo "claude code images e2e: ok (the tower read the PNG; the text-only model went on)"
