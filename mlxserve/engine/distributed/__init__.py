"""Distributed serving: rank 0 decides, every rank executes (rule 12 of docs/architecture.md).

Rank 0 runs the HTTP server, the scheduler, the prefix cache's policy and the
sampler. Before each run it sends the step's plan (`codec.WirePlan`)
with one `mx.distributed` collective (two for a long prompt), and every rank
runs the same `Runner` forwards on its shard of the model: tensor parallel
forwards sum inside each layer, pipeline forwards pass the hidden state from
stage to stage, so no rank can run ahead of the others. A follower waits for
the next plan asleep on a socket to rank 0 (`wakeup.PlanWakeup`), not in the
collective, which busy-polls on MLX's ring backend.

Only rank 0's sampled tokens count: they reach the other ranks in the next
plan, whose runners feed them (decode-ahead is off, since it would feed a
rank's own draws). The other ranks hold their shard of every prefix-cache
entry; rank 0's prefix cache reports each decision (`PrefixCacheObserver`)
and the followers replay that journal, so an entry is created, handed out
and dropped on every rank together. A collective that fails (a peer gone)
raises `PeerLost`, which ends the engine: open requests fail, `/health`
turns 503.
"""
