"""parsers stage (see DESIGN.md)."""
