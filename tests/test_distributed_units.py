"""Distributed serving's refusals and checks that need no second rank."""

from __future__ import annotations

import pytest

from mlxserve.api.serve import run
from mlxserve.cli import build_parser
from mlxserve.config import EngineConfig
from mlxserve.models.loaded import ModelLoadError
from mlxserve.models.shard import Sharding, even_split


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def test_v41_tensor_parallel_is_refused_with_the_reason() -> None:
    with pytest.raises(ModelLoadError, match="no tensor-parallel sharding.*pipeline"):
        Sharding("tensor", _Group())(object(), "deepseek_v41")


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="tensor, pipeline"):
        Sharding("expert", _Group())(object(), "llama")


def test_v41_pipeline_decodes_each_request_alone() -> None:
    assert not Sharding("pipeline", _Group()).batchable("deepseek_v41")
    assert Sharding("tensor", _Group()).batchable("llama")


def test_layers_split_like_mlx_lm() -> None:
    assert even_split(5, 2) == [3, 2]
    assert even_split(4, 2) == [2, 2]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"speculative": "ngram"}, "speculative"),
        ({"prefix_cache_dir": "/tmp/x"}, "prefix-cache-dir"),
        ({"distributed": "expert"}, "tensor or pipeline"),
    ],
)
def test_distributed_config_refusals(extra: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"distributed": "tensor", **extra}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)  # type: ignore[arg-type]


def test_serve_distributed_alone_says_to_use_mlx_launch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["serve", "some-model", "--distributed", "pipeline"])
    assert run(args) == 2
    assert "mlx.launch" in capsys.readouterr().err
