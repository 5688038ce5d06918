"""Speculative decoding inside the batch: drafts (n-gram and MTP), the verify
step the runner calls, and the rollback of rejected positions."""
