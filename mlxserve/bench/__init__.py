"""bench stage (see docs/architecture.md)."""
