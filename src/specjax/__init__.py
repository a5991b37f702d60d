"""specjax: fast, lossless LLM inference in JAX with block-diffusion speculative decoding (DFlash)."""

__version__ = "0.1.0"
