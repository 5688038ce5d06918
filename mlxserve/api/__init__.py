"""api stage (see DESIGN.md)."""
