"""KV page ownership on the host."""
