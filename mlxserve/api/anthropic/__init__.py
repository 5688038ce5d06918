"""Anthropic Messages: protocol, convert, events, routes."""
