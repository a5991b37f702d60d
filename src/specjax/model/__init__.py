"""Target models (Llama, Qwen2, Qwen3), their layers, paged attention and checkpoint loaders."""
