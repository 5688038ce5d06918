"""engine stage (see DESIGN.md)."""
