"""OpenAI Responses: protocol, convert, events, store, routes."""
