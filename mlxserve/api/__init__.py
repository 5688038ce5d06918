"""api stage (see docs/architecture.md)."""
