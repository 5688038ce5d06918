"""OpenAI chat and text completions: protocol, convert, events, routes."""
