"""Host-side engine: sequences, buckets, jitted step functions and the scheduler loop."""
