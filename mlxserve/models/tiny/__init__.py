"""Checkpoints the product ships: seeded random weights (`make-model`), the
scripted checkpoint for real tool calls, and the demo."""
