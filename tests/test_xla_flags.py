"""specjax's XLA flags: set at import without overriding the user's, and the memory they exist for."""

import subprocess
import sys

from specjax.xla_flags import FLAGS, configure


def test_flags_added_once_and_user_values_kept():
    env = {}
    first = configure(env)
    assert first == " ".join(f"{k}={v}" for k, v in FLAGS.items())
    assert configure(env) == first
    flag = next(iter(FLAGS))
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {flag}=true"}
    assert configure(env) == f"--xla_force_host_platform_device_count=2 {flag}=true"


def test_batched_decode_temporaries_do_not_grow_with_layers():
    """A fresh process (the flag must be set before the backend starts): a decode step's temporaries stay below
    one layer's gathered K/V.  With XLA:CPU's concurrency-optimized scheduler every layer keeps its own."""
    code = """
import specjax, jax, jax.numpy as jnp
from tests.helpers import make_hf_checkpoint
import tempfile
from specjax.llm import LLM
from specjax.config import EngineConfig
from specjax.engine.programs import StepShape
d = make_hf_checkpoint("llama", tempfile.mkdtemp() + "/m")
llm = LLM(d, None, "ar", None, EngineConfig(page_size=16, max_model_len=256, max_num_seqs=8))
e = llm.engine
step, _ = e.programs.build_now(StepShape("decode", 8, 0, 16, "greedy"))
c = e.tcfg
one_layer = 2 * 8 * 256 * c.num_kv_heads * c.head_dim * 4
print(step.memory_analysis().temp_size_in_bytes, one_layer, c.num_layers)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    temp, one_layer, layers = map(int, out.stdout.split())
    assert layers >= 2 and temp < one_layer, (temp, one_layer)
