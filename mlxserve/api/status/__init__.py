"""`/v1/status` and the operator page."""
