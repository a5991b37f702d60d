"""XLA flags specjax sets for its programs, once, before the XLA backend starts (`import specjax` applies them).

`--xla_cpu_enable_concurrency_optimized_scheduler=false`: XLA:CPU's default scheduler orders a program for
concurrent execution of independent operations and gives each of them its own buffer; for a 30-layer target
every layer's gathered KV pages then live at once.  A batch-16 SmolLM2 decode step over a 2048-token context
needed 1441 MB of temporaries with it and 27 MB without (docs/results/startup.md), which is
most of the memory a loaded server held.  A flag the user already put in XLA_FLAGS is left as they set it.
"""

from __future__ import annotations

import os

FLAGS = {"--xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def configure(environ=os.environ) -> str:
    """Add FLAGS to environ["XLA_FLAGS"] unless already named there; returns the resulting value."""
    current = environ.get("XLA_FLAGS", "")
    named = {item.split("=", 1)[0] for item in current.split()}
    extra = [f"{flag}={value}" for flag, value in FLAGS.items() if flag not in named]
    if extra:
        environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return environ.get("XLA_FLAGS", "")
