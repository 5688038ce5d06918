"""`serve ORG/NAME[@REVISION]`: Hugging Face ids resolve through a hub cache the tests lay
out themselves (HF_HUB_OFFLINE=1, no network); a model that cannot load ends `serve`
with the reason on stderr and a non-zero status, before it binds its port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from api_fixtures import ServeProcess, free_port, serve_args

from mlxserve.api import serve
from mlxserve.models.loaded import LoadedModel, ModelLoadError
from mlxserve.models.resolve import parse_hub_id

pytestmark = pytest.mark.slow

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(
    home: Path, repo_id: str, model_dir: Path, commit: str = COMMIT, ref: str = "main"
) -> Path:
    """`home/hub/models--ORG--NAME/{refs/REF, snapshots/COMMIT/...}`, as the hub writes it."""
    folder = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME, offline, for this test and the processes it starts."""
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def resolve_in_process(specs: list[str], cwd: Path) -> list[str]:
    """`resolve_model` of each spec in one fresh interpreter (huggingface_hub reads its
    environment once, at import, so each case's environment gets its own process): the
    folder each names, or `error: <its ModelLoadError>`."""
    code = (
        "import sys\n"
        "from mlxserve.models.loaded import ModelLoadError\n"
        "from mlxserve.models.resolve import resolve_model\n"
        "for spec in sys.argv[1:]:\n"
        "    try:\n"
        "        print('resolved:', resolve_model(spec))\n"
        "    except ModelLoadError as e:\n"
        "        print('error:', ' '.join(str(e).split()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *specs],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    answers = [
        line for line in done.stdout.splitlines() if line.startswith(("resolved:", "error:"))
    ]
    assert len(answers) == len(specs), done.stdout
    return [a.removeprefix("resolved: ") for a in answers]


def test_hub_ids_parse() -> None:
    assert parse_hub_id("mlx-community/Qwen3-0.6B-4bit") == ("mlx-community/Qwen3-0.6B-4bit", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_id(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for not_an_id in ("name", "/abs/path", "./rel/dir", "a/b/c", "org/", "org/name@"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_ids_resolve_through_the_cache_and_a_directory_wins(
    offline_hub: Path, tmp_path: Path, model_dir_factory: Callable[..., Path]
) -> None:
    model = model_dir_factory("llama")
    main = lay_out_hub_cache(offline_hub, REPO, model)
    other = "fedcba9876543210fedcba9876543210fedcba98"
    tagged = lay_out_hub_cache(offline_hub, REPO, model, commit=other, ref="v2")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    cases = {REPO: main, f"{REPO}@v2": tagged, f"{REPO}@{COMMIT}": main}
    for (spec, want), got in zip(
        cases.items(), resolve_in_process([*cases], elsewhere), strict=True
    ):
        assert Path(got) == want, (spec, got)
    # A directory of the same name, where the server runs, is what the user meant.
    local = elsewhere / REPO
    shutil.copytree(model, local)
    here, unknown = resolve_in_process([REPO, "nobody/nothing"], elsewhere)
    assert here == REPO
    assert unknown.startswith("error:") and "nobody/nothing" in unknown
    assert "HF_HUB_OFFLINE" in unknown


def test_serve_loads_a_hub_id_from_the_cache(
    offline_hub: Path, model_dir_factory: Callable[..., Path]
) -> None:
    from openai import OpenAI

    lay_out_hub_cache(offline_hub, REPO, model_dir_factory("llama"))
    with ServeProcess(REPO) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == [REPO]
        reply = client.chat.completions.create(
            model=REPO,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            temperature=0,
        )
        assert reply.model == REPO and reply.usage is not None
        assert reply.usage.completion_tokens >= 1


def test_an_unknown_id_exits_non_zero_before_binding(offline_hub: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "mlxserve.cli", "serve", "nobody/nothing", "--port", str(port)]
    # The port is held here: a server that tried to bind would fail with "address in use".
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "nobody/nothing" in done.stderr and "HF_HUB_OFFLINE" in done.stderr
    assert "address already in use" not in done.stderr.lower()
    assert "Traceback" not in done.stderr


def _broken_copy(model_dir: Path, out: Path, change: Callable[[Path], None]) -> Path:
    shutil.copytree(model_dir, out)
    change(out)
    return out


def _retype(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no_such_family"
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda p: (p / "model.safetensors").unlink(), "safetensors"),
        (lambda p: (p / "tokenizer.json").unlink(), "tokenizer"),
        (_retype, "no_such_family"),
    ],
    ids=["no-weights", "no-tokenizer", "unknown-family"],
)
def test_a_model_that_cannot_load_stops_serve_before_it_binds(
    change: Callable[[Path], None],
    reason: str,
    tmp_path: Path,
    model_dir_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broken = _broken_copy(model_dir_factory("llama"), tmp_path / "broken", change)

    def must_not_bind(*_: object) -> int:
        raise AssertionError("serve bound its port for a model it cannot load")

    monkeypatch.setattr(serve, "serve_app", must_not_bind)
    assert serve.run(serve_args(model=str(broken))) == 2
    assert reason in capsys.readouterr().err


def test_a_load_that_fails_on_the_engine_thread_ends_serve_non_zero() -> None:
    """What the pre-bind checks cannot see (a bad weight file, say) still ends the process:
    a server whose model never loads must not stay up answering 503 forever."""

    def broken_loader() -> LoadedModel:
        raise ModelLoadError("weights in /nowhere are corrupt")

    args = serve_args()
    app, served = serve.build_app(args, loader=broken_loader)
    state = served.default
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(serve.serve_app(app, served, args.host, args.port, "error")),
        daemon=True,
    )
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and result == [1]
    assert state.engine.load_error is not None and "corrupt" in state.engine.load_error
