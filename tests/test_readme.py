"""The README's commands, run as written (ports, `.venv/bin/` and `/tmp/` substituted).

`make serve`'s own recipe is read from the Makefile and started; the README's
`curl` commands then run against it. The "serving a real checkpoint" block
runs line by line, its `serve` started and probed. The repository stands
alone: every relative link of the README names a file inside it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_fixtures import free_port
from server_health import wait_healthy

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")

pytestmark = pytest.mark.slow


def sh_commands() -> list[str]:
    """The command lines of the README's ```sh blocks (continuations joined, comments cut)."""
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", README, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _argv(command: str, tmp: Path, port: int | None = None) -> list[str]:
    """One README command as an argv for this checkout's interpreter."""
    if port is not None:
        command = re.sub(r"(127\.0\.0\.1:|--port )\d+", lambda m: f"{m.group(1)}{port}", command)
    command = command.replace("/tmp/", f"{tmp}/")
    argv = shlex.split(command)
    if argv[0] == ".venv/bin/mlxserve":
        return [sys.executable, "-m", "mlxserve.cli", *argv[1:]]
    if argv[0] == ".venv/bin/python":
        return [sys.executable, *argv[1:]]
    return argv


def make_serve_argv(port: int) -> list[str]:
    """`make serve`'s recipe with the Makefile's defaults, BIN as this interpreter."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^serve:.*\n\t(.+)$", makefile, flags=re.MULTILINE)
    assert recipe is not None
    defaults = dict(re.findall(r"^(HOST|PORT) \?= (\S+)$", makefile, flags=re.MULTILINE))
    line = recipe.group(1).replace("$(HOST)", defaults["HOST"]).replace("$(PORT)", str(port))
    argv = shlex.split(line)
    assert argv[0] == "$(BIN)/mlxserve" and defaults["PORT"] == "8000", line
    return [sys.executable, "-m", "mlxserve.cli", *argv[1:]]


def _started(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """This checkout first on the path; the demo model converted in a temporary cache."""
    from real_model import smollm2_gguf_path

    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    # The demo's GGUF, fetched once per machine, laid into a fresh cache: the server
    # converts it there as a first `make serve` does.
    cache = tmp_path_factory.mktemp("mlxserve-cache")
    (cache / "demo").mkdir()
    (cache / "demo" / smollm2_gguf_path().name).symlink_to(smollm2_gguf_path())
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "MLXSERVE_CACHE_DIR": str(cache)}


@pytest.fixture(scope="module")
def make_serve(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    proc = _started(make_serve_argv(port), env, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=180)
        yield port
    finally:
        _stop(proc)


def test_readme_curl_commands_succeed(make_serve: int, tmp_path: Path) -> None:
    # (The Images section's example needs --images-for-text-models placeholder, which
    # `make serve` does not set: tests/test_api_images.py runs it against such a server.)
    curls = [c for c in sh_commands() if c.startswith("curl ") and "image_url" not in c]
    assert len(curls) >= 3 and any('"stream": true' in c for c in curls)
    for command in curls:
        done = subprocess.run(
            _argv(command, tmp_path, make_serve), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (command, done.stderr)
        out = done.stdout
        if '"stream": true' in command:
            events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", out
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks and all("error" not in c for c in chunks), out
            assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks), out
        else:
            body = json.loads(out)
            assert "error" not in body, body
            if "chat/completions" in command:
                assert body["model"] == "mlxserve-demo" and body["usage"]["completion_tokens"] > 0
                if "capital of France" in command:  # the trained demo model's greedy answer
                    assert "Paris" in body["choices"][0]["message"]["content"], body


def test_readme_checkpoint_walkthrough(env: dict[str, str], tmp_path: Path) -> None:
    block = [c for c in sh_commands() if c.startswith(".venv/bin/")]
    assert [shlex.split(c)[1] for c in block] == ["make-model", "-m", "serve"], block
    port = free_port()
    *prepare, serve = [_argv(c, tmp_path, port) for c in block]
    for argv in prepare:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (argv, done.stderr[-3000:])
    proc = _started(serve, env, tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout=180)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert models[0]["id"] == "llama" and models[0]["max_model_len"] > 0
    finally:
        _stop(proc)


def test_version() -> None:
    from importlib.metadata import version

    done = subprocess.run(
        [sys.executable, "-m", "mlxserve.cli", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == f"mlxserve {version('mlxserve')}"


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md", "tests/data/README.md"])
def test_docs_stand_alone(doc: str) -> None:
    """Relative links resolve inside the repository; no machine paths."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        resolved = ((ROOT / doc).parent / target).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), (doc, target)
    assert not re.search(r"\.\./shared|/work/|/root/", text), doc


def test_code_cites_no_machine_paths() -> None:
    for path in [*(ROOT / "mlxserve").rglob("*.py"), ROOT / "Makefile", ROOT / "pyproject.toml"]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\.\./shared|/work/|/root/|shared/DESIGN", text), path
