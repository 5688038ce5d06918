"""cache stage (see DESIGN.md)."""
