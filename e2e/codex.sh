#!/usr/bin/env bash
# Codex CLI against mlxserve over the Responses API (wire_api = "responses").
#
# Installs @openai/codex from npm into a scratch directory, serves a scripted
# DeepSeek-V4 checkpoint whose first turn calls Codex's `exec_command` tool and
# whose second turn answers in text, runs `codex exec`, and checks that Codex
# ran the command, sent its output back, printed the scripted answer, and that
# the second turn hit the prefix cache. Loopback traffic only.
#
#   bash e2e/codex.sh            (PYTHON=path/to/python, CODEX_VERSION=x.y.z, KEEP=1)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
CODEX_VERSION="${CODEX_VERSION:-latest}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mlxserve-codex.XXXXXX")"
MARKER="mlxserve-codex-ok"
ANSWER="The command printed $MARKER."
SERVER_PID=""

cleanup() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [[ -z "${KEEP:-}" ]]; then rm -rf "$WORK"; else echo "kept $WORK"; fi
}
trap cleanup EXIT

fail() {
    echo "codex e2e: FAIL: $*" >&2
    for f in server.log codex.out codex.err; do
        [[ -f "$WORK/$f" ]] && { echo "--- $f" >&2; tail -40 "$WORK/$f" >&2; }
    done
    exit 1
}

echo "codex e2e: installing @openai/codex@$CODEX_VERSION in $WORK"
(cd "$WORK" && npm install --silent --no-audit --no-fund "@openai/codex@$CODEX_VERSION" >npm.log 2>&1) ||
    fail "npm install failed (see $WORK/npm.log)"
CODEX="$WORK/node_modules/.bin/codex"
"$CODEX" --version

# Turn 1: reasoning, then a DSML call of exec_command; turn 2: the answer.
CALL='The user wants me to run a command.</think>

<｜DSML｜tool_calls>
<｜DSML｜invoke name="exec_command">
<｜DSML｜parameter name="cmd" string="true">echo '"$MARKER"'</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>'
"$PYTHON" -m mlxserve.cli make-model "$WORK/ckpt" --family scripted \
    --script "$CALL" --script "The command ran.</think>$ANSWER" >/dev/null

PORT="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$PYTHON" -m mlxserve.cli serve "$WORK/ckpt" --port "$PORT" --served-model-name scripted \
    >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || fail "the server exited"
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || fail "the server did not become ready"

mkdir -p "$WORK/home" "$WORK/project"
cat >"$WORK/home/config.toml" <<EOF
model = "scripted"
model_provider = "mlxserve"

[model_providers.mlxserve]
name = "mlxserve"
base_url = "http://127.0.0.1:$PORT/v1"
wire_api = "responses"
EOF

echo "codex e2e: codex exec against http://127.0.0.1:$PORT/v1"
(cd "$WORK/project" && CODEX_HOME="$WORK/home" timeout 180 "$CODEX" exec --skip-git-repo-check \
    "Run the shell command: echo $MARKER" </dev/null >"$WORK/codex.out" 2>"$WORK/codex.err") ||
    fail "codex exec exited with $?"

grep -q "echo $MARKER" "$WORK/codex.err" || fail "codex did not run the exec_command call"
grep -q "succeeded" "$WORK/codex.err" || fail "the command did not succeed"
grep -qF "$ANSWER" "$WORK/codex.out" || fail "codex did not print the scripted answer"

METRICS="$(curl -sf "http://127.0.0.1:$PORT/metrics")"
# Prometheus writes counters as floats ("2.0"): keep the integer part.
ok="$(grep -E '^mlxserve_requests_total\{endpoint="responses",model_name="[^"]*",outcome="ok"\}' <<<"$METRICS" | awk '{printf "%d", $2}')"
cached="$(grep -E '^mlxserve_cached_prompt_tokens_total\{' <<<"$METRICS" | awk '{printf "%d", $2}')"
echo "codex e2e: responses_ok=${ok:-0} cached_prompt_tokens=${cached:-0}"
[[ "${ok:-0}" -ge 2 ]] || fail "expected at least 2 successful /v1/responses calls"
[[ "${cached:-0}" -gt 0 ]] || fail "the second turn did not hit the prefix cache"
echo "codex e2e: PASS"
