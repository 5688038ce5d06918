"""DeepSeek-V4 and V4.1: their batched caches, the overlap window, V4.1's cache
and math, and the multi-token-prediction head."""
