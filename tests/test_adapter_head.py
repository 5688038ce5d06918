"""The adapter's CPU head for decode batches gives lm_head's own logits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxserve.models.adapter import _head


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_head_equals_lm_head(rows: int, dtype: mx.Dtype) -> None:
    head = nn.Linear(64, 1000, bias=False)
    head.set_dtype(dtype)
    hidden = mx.random.normal((rows, 1, 64), key=mx.random.key(rows)).astype(dtype)
    ours, theirs = _head(head, hidden), head(hidden)
    assert ours.shape == theirs.shape == (rows, 1, 1000) and ours.dtype == theirs.dtype
    assert mx.allclose(ours, theirs, atol=1e-2 if dtype == mx.bfloat16 else 1e-5).item()


def test_head_with_bias_is_lm_head() -> None:
    head = nn.Linear(64, 100)
    hidden = mx.random.normal((3, 1, 64), key=mx.random.key(0))
    assert mx.array_equal(_head(head, hidden), head(hidden)).item()
