"""Measurement: per-dataset benchmarks, the verify-cost curve (kflat) and acceptance theory."""
