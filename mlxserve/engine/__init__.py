"""engine stage (see docs/architecture.md)."""
