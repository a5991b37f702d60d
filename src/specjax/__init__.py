"""specjax: fast, lossless LLM inference in JAX with block-diffusion speculative decoding (DFlash)."""

from specjax.xla_flags import configure as _configure_xla

__version__ = "0.1.0"

_configure_xla()  # before the XLA backend starts: see specjax/xla_flags.py
