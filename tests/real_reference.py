"""mlx-lm's own greedy answers on a checkpoint, computed in a process of their own.

`python tests/real_reference.py CHECKPOINT REQUESTS.json` reads a JSON list of
`[prompt, max_tokens]` and prints one JSON line per request, in order, as soon
as it is computed: `{"key": "prompt\nmax_tokens", "tokens", "text", "ended"}`.
Each prompt is one user turn through the checkpoint's chat template and
`mlx_lm.generate.stream_generate` (greedy). The real-weights tests start it
first, so the oracle computes while the server under test starts and answers
(on the CPU backend each answer costs seconds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    checkpoint, requests = sys.argv[1], Path(sys.argv[2])
    model, tokenizer = load(checkpoint)
    for prompt, max_tokens in json.loads(requests.read_text()):
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tokens = [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]
        ended = bool(tokens) and tokens[-1] in tokenizer.eos_token_ids
        text = tokenizer.decode(tokens[:-1] if ended else tokens)
        answer = {"key": f"{prompt}\n{max_tokens}", "tokens": tokens, "text": text, "ended": ended}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
