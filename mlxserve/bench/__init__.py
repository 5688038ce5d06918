"""bench stage (see DESIGN.md)."""
