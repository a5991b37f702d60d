"""OpenAI-compatible HTTP serving: engine thread, request protocol, Prometheus metrics."""
