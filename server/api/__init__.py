"""The HTTP API: routes, request and response shapes, errors, middleware."""
