"""Checkpoints as users have them: converted by the dependencies' own converters.

Each family's tiny synthetic checkpoint (`mlxserve make-model`) is sharded
like a Hugging Face download (two files and an index), converted and
quantized by `mlx_lm convert` (llama, qwen3, deepseek_v41) or `mlx_vlm
convert` (deepseek_v4), re-sharded the way large conversions are, then loaded
from disk by `mlxserve serve`'s own loader and served over HTTP to the real
`openai` client. The converters expose no shard-size option, hence the
re-sharding here. The converters run in this process (their commands' own
function): the README walkthrough test runs `mlx_lm convert` as a command.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from api_fixtures import ServerThread, serve_args

from mlxserve.cli import main as cli_main

pytestmark = pytest.mark.slow

# family -> (converter package, its `convert` options, expected quantization)
CONVERSIONS: dict[str, tuple[str, dict[str, object], dict[str, object]]] = {
    "llama": ("mlx_lm", {}, {"bits": 4, "mode": "affine"}),
    "qwen3": ("mlx_lm", {"q_bits": 8}, {"bits": 8, "mode": "affine"}),
    "deepseek_v41": ("mlx_lm", {"q_mode": "mxfp4"}, {"bits": 4, "mode": "mxfp4"}),
    "deepseek_v4": ("mlx_vlm", {}, {"bits": 4, "mode": "affine"}),
}


def _convert(package: str, hf: Path, mlx: Path, options: dict[str, object]) -> None:
    """The converter's own `convert` (what its `convert` command calls), in this process:
    the README's walkthrough runs the command itself."""
    module = importlib.import_module(package)
    module.convert(str(hf), str(mlx), quantize=True, **options)


def shard(directory: Path, names: tuple[str, str]) -> None:
    """Split `directory`'s weights into two files named `names`, with an index."""
    import mlx.core as mx

    files = sorted(directory.glob("*.safetensors"))
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
        f.unlink()
    keys = sorted(weights)
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2 :])
    weight_map: dict[str, str] = {}
    for name, part in zip(names, halves, strict=True):
        mx.save_safetensors(str(directory / name), {k: weights[k] for k in part}, {"format": "mlx"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(int(a.nbytes) for a in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> a quantized, sharded MLX conversion of its tiny checkpoint."""
    root = tmp_path_factory.mktemp("converted")
    out: dict[str, Path] = {}
    for family, (converter, options, _) in CONVERSIONS.items():
        hf, mlx = root / f"{family}-hf", root / f"{family}-mlx"
        assert cli_main(["make-model", str(hf), "--family", family]) == 0
        shard(hf, ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
        _convert(converter, hf, mlx, options)
        shard(mlx, ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
        out[family] = mlx
    return out


@pytest.fixture(params=list(CONVERSIONS), scope="module")
def served(request: pytest.FixtureRequest, converted: dict[str, Path]) -> Iterator[ServerThread]:
    family = request.param
    args = serve_args("--served-model-name", family, model=str(converted[family]))
    with ServerThread(args, None) as server:  # type: ignore[arg-type]
        yield server


def _text(message: object) -> str:
    """Content and reasoning together (DeepSeek models may start in thinking mode)."""
    content = getattr(message, "content", None) or ""
    return str(getattr(message, "reasoning_content", None) or "") + content


def test_conversions_are_quantized_and_sharded(converted: dict[str, Path]) -> None:
    for family, (_, _, quantization) in CONVERSIONS.items():
        config = json.loads((converted[family] / "config.json").read_text())
        for key, value in quantization.items():
            assert config["quantization"][key] == value, (family, config["quantization"])
        index = json.loads((converted[family] / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == 2
        assert any(k.endswith(".scales") for k in index["weight_map"]), family


def test_serves_a_converted_checkpoint(served: ServerThread) -> None:
    name = served.state.model_name
    assert served.state.load_progress is not None
    assert served.state.load_progress.fraction == 1.0
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}
        card = http.get("/v1/models").json()["data"][0]
        assert card["id"] == name and card["max_model_len"] > 0
    client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(
        model=name,
        messages=messages,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.model == name and reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 4
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(_text(c.choices[0].delta) for c in chunks if c.choices)
    assert streamed == _text(reply.choices[0].message)
    text = client.completions.create(model=name, prompt="Once upon a time", max_tokens=3)
    assert text.usage is not None and text.usage.completion_tokens >= 1
