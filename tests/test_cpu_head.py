"""The CPU head (`cpu_head.SplitHead`) gives nn.Linear's own logits, bit for bit."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxserve.models import cpu_head
from mlxserve.models.load import load

# The split head is the CPU backend's (reference BLAS); elsewhere it is not used.
pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="the split lm_head is a CPU-backend optimisation"
)


class _WithHead(nn.Module):
    def __init__(self, dtype: mx.Dtype = mx.float32, bias: bool = False, vocab: int = 1000) -> None:
        super().__init__()
        self.lm_head = nn.Linear(64, vocab, bias=bias)
        self.lm_head.set_dtype(dtype)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize(("rows", "length"), [(1, 1), (2, 1), (5, 1), (3, 7)])
def test_the_split_head_keeps_the_logits_bit_for_bit(parts: int, rows: int, length: int) -> None:
    module = _WithHead(vocab=1000)
    hidden = mx.random.normal((rows, length, 64), key=mx.random.key(rows * 10 + length))
    before = module.lm_head(hidden)
    mx.eval(before)
    assert cpu_head.install(module, parts)
    assert isinstance(module.lm_head, cpu_head.SplitHead)
    assert len(module.lm_head.parts) == parts
    after = module.lm_head(hidden)
    assert after.shape == before.shape == (rows, length, 1000)
    assert mx.array_equal(after, before).item()


def test_the_split_head_runs_on_any_thread() -> None:
    """Streams belong to the thread that made them: each thread gets its own."""
    module = _WithHead()
    hidden = mx.random.normal((2, 1, 64), key=mx.random.key(1))
    expected = module.lm_head(hidden)
    mx.eval(expected)
    cpu_head.install(module, 2)
    results: list[bool] = []

    def run() -> None:
        try:
            results.append(mx.array_equal(module.lm_head(hidden), expected).item())
        finally:
            mx.clear_streams()

    for _ in range(2):
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    results.append(mx.array_equal(module.lm_head(hidden), expected).item())
    assert results == [True, True, True]


@pytest.mark.parametrize(
    ("dtype", "bias"), [(mx.bfloat16, False), (mx.float16, False), (mx.float32, True)]
)
def test_half_precision_and_biased_heads_are_left_as_they_are(dtype: mx.Dtype, bias: bool) -> None:
    module = _WithHead(dtype, bias)
    head = module.lm_head
    assert not cpu_head.install(module)
    assert module.lm_head is head


def test_quantized_heads_and_modules_without_a_head_are_left_alone() -> None:
    module = nn.Module()
    module.lm_head = nn.QuantizedLinear(64, 1000, bias=False)
    assert not cpu_head.install(module)
    assert isinstance(module.lm_head, nn.QuantizedLinear)
    assert not cpu_head.install(nn.Module())


def test_a_loaded_float32_checkpoint_gets_the_split_head(tmp_path: Path) -> None:
    from mlxserve.models.tiny.synthetic import make_model

    path = make_model(tmp_path / "qwen3", "qwen3", seed=0)
    model = load(path)
    assert isinstance(model.model.module.lm_head, cpu_head.SplitHead)
    assert len(model.model.module.lm_head.parts) == min(
        cpu_head.MAX_PARTS, cpu_head.available_cores()
    )
