"""The HTTP server and its hardening: one route table (routes.py), the handlers, middlewares,
connection limits, request bodies, origins, API keys, metrics and the chat page."""
