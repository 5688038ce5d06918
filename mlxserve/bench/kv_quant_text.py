"""The fixed text `mlxserve bench kv-quant` teacher-forces a trained model through.

Prose and Python, as an agent's context holds both; written for this benchmark
(so it is nobody's licensed text) and never to be edited: its figures are
comparable only over the same tokens. About 2,000 SmolLM2 tokens.
"""

TEXT = '''\
# Notes from a week of serving a coding model on one laptop

On the first morning the server answered every request in under a second, and by the
afternoon it was refusing new sessions. Nothing was wrong with the model. Three agents
had each opened a conversation of about a hundred thousand tokens, and the keys and
values the attention layers keep for every past token had grown until they no longer
fit beside the weights. The weights are fixed when the process starts; the cache grows
with every token a conversation adds, and on a machine with unified memory it competes
with everything else the user has open.

There are three ways to make room. The first is to keep fewer tokens: sliding windows,
summaries, or simply a shorter context, all of which change what the model can see.
The second is to keep the tokens somewhere slower, on disk or in compressed form, and
bring them back when a conversation returns. The third is to keep every token but spend
fewer bytes on each, which is what a quantized cache does. A key vector of one hundred
and twenty-eight half-precision numbers takes two hundred and fifty-six bytes. Split it
into groups of sixty-four, store each number as an eight-bit code, and keep one scale
and one offset per group, and the same vector takes one hundred and thirty-six bytes.
With four-bit codes it takes seventy-two.

The cost is error. Every stored number is rounded to the nearest of two hundred and
fifty-six levels, or sixteen, spread between the smallest and largest value of its
group. Attention multiplies each query by every stored key, so the rounding shows up
in the scores, then in the softmax that turns scores into weights, and finally in the
mixture of values each position reads. Most of the time the largest weights stay the
largest and the model picks the same next token. Sometimes two candidates were nearly
tied, and the rounding tips the balance. Whether that matters depends on what follows:
a different synonym in prose is harmless, a different variable name in code is a bug.

So the question for a server is not whether quantization changes the output, because
it does, but how often and by how much, measured on a real model over real text. Two
numbers answer it well enough. Top-one agreement is the share of positions where the
quantized cache and the full-precision cache make the same greedy choice, given the
same text so far. The mean Kullback-Leibler divergence says how far the whole predicted
distribution moved, averaged over positions, in nats. Both are measured by teacher
forcing: the text is fed as it is, and at every position both runs predict the next
token from the same history, so one early disagreement does not send the two runs down
different paths and spoil every later comparison.

The second lesson of the week was that memory has to be measured, not assumed. A
quantized cache that is dequantized to full precision before every attention step
saves nothing at the moment that matters, because the full copy exists, if only for a
layer at a time. Buffers that grow by concatenation hold the old and the new block at
once. The only reliable figure is the allocator's peak during a long prefill and a few
decode steps, compared with the same run at full precision.

The third lesson was about batching. A server that decodes many conversations at once
keeps their caches side by side, padded on the left so that every row ends at the same
position, and runs one forward for all of them. If one conversation's cache is
quantized and another's is not, they cannot share that forward. So every row of a batch
must use the same form, and the simplest rule is the strictest: quantize every request
from its first token. Then a cached prefix, a restored file, a row of a batch and a
request running alone all hold the same numbers for the same tokens, and a greedy run
gives the same answer whichever way its tokens arrived.

What follows is the small piece of code that decides how many sessions fit.

```python
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheCost:
    """An upper bound on one request's cache bytes for the tokens it holds."""

    fixed_bytes: int
    bytes_per_token: float

    def row(self, tokens: int) -> int:
        return self.fixed_bytes + int(self.bytes_per_token * max(tokens, 0) + 0.999)

    def batch(self, lengths: list[int]) -> int:
        """Rows are left-padded to the longest, so a batch costs rows times the longest."""
        if not lengths:
            return 0
        return len(lengths) * self.row(max(lengths))


def sessions_that_fit(cost: CacheCost, budget: int, tokens: int, limit: int = 1024) -> int:
    """How many requests of `tokens` tokens can hold their caches at once."""
    count = 0
    while count < limit and cost.batch([tokens] * (count + 1)) <= budget:
        count += 1
    return count


def quantized_bytes_per_value(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Bytes one cached number takes: its code, plus its share of a scale and a bias."""
    return bits / 8 + 2 * scale_bytes / group_size


def describe(bits: int | None, group_size: int = 64) -> str:
    if bits is None:
        return "full precision: 2 bytes per value"
    per_value = quantized_bytes_per_value(bits, group_size)
    return f"{bits}-bit codes in groups of {group_size}: {per_value:.3f} bytes per value"


if __name__ == "__main__":
    full = CacheCost(fixed_bytes=4096, bytes_per_token=98_304)
    eight = CacheCost(fixed_bytes=4096, bytes_per_token=98_304 * 0.53125)
    budget = 24 * 1024**3
    for name, cost in (("full", full), ("8-bit", eight)):
        print(name, sessions_that_fit(cost, budget, tokens=100_000))
    for bits in (None, 8, 4):
        print(describe(bits))
```

Run it and the arithmetic is plain: at about ninety-six kilobytes per token, a
twenty-four gigabyte budget holds two conversations of a hundred thousand tokens in
full precision and four at eight bits. That is the whole argument for the feature,
and also its limit. Four sessions instead of two is a real difference on a laptop;
it is not a substitute for a bigger machine when the conversations keep growing.

The last thing worth writing down is the order in which to check a change like this.
First, that the same text gives the same tokens alone, in a batch, after a cache hit
and after a restart. Second, that the memory figures come from the allocator and the
probe, not from a formula in a comment. Third, and only then, how fast it runs, on the
machine users have, because the kernels that read packed codes are tuned for one kind
of processor and merely correct on the others. A feature that is fast and wrong is
worse than one that is slow and right, and a benchmark that cannot tell them apart is
not a benchmark at all.

Appendix: a checklist for reviewing a cache change.

1. Does every path that copies a cache know the new class? Snapshots, disk files,
   batch merges and row extraction each take a cache apart and build it back.
2. Does the signature of stored entries change with the setting, so a file written in
   one mode is never read in another?
3. Does the memory probe measure the new form, and does admission use it?
4. Is a model whose caches cannot be converted refused before the port is bound, with
   a message that names the model and the reason?
5. Are the quality figures reproducible: a fixed text, a fixed model, a fixed count of
   tokens, and both runs fed exactly the same positions?
'''
