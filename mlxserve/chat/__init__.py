"""chat stage (see DESIGN.md)."""
