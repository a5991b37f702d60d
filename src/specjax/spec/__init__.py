"""Speculative decoding: lossless acceptance, proposers and the readable single-request reference loop."""
