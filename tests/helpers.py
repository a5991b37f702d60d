"""Builders for tiny random checkpoints in the real formats (HF safetensors dirs, GGUF, z-lab drafters)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from specjax.spec.proposer import HostProposer

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB = 300  # 256 byte tokens + specials + unused rows
# A GSM8K-style question the real-weight tests ask SmolLM2 (its greedy answer runs past 64 tokens)
SMOLLM_PROMPT = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?"


def cpu_env(devices: int | None = None) -> dict[str, str]:
    """The environment for a process a test starts: this one's (the suite's XLA flags included), on the CPU, with
    `devices` virtual CPU devices when given (XLA reads the flag when the process's backend starts)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if devices is not None:
        flag = "--xla_force_host_platform_device_count"
        kept = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != flag]
        env["XLA_FLAGS"] = " ".join([*kept, f"{flag}={devices}"])
    return env


def tiny_hf_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    if family == "llama":
        common.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      rope_theta=500000.0)
        cls = LlamaConfig
    elif family == "qwen2":
        common.update(rope_theta=10000.0, tie_word_embeddings=True)
        cls = Qwen2Config
    else:
        common.update(head_dim=24, rope_theta=1000000.0)  # head_dim != hidden / heads, as in real Qwen3
        cls = Qwen3Config
    common.update(overrides)
    return cls(**common)


def randomize(model, seed: int = 0, std: float = 0.15):
    """Peaked random weights (HF's 0.02 init gives near-uniform logits and fragile argmax comparisons)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model


def make_hf_model(family: str, seed: int = 0, **overrides):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, **overrides), dtype=torch.float32)
    return randomize(model, seed).eval()


def write_byte_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer with 256 byte tokens + <s>, </s>, <|im_start|>, <|im_end|> and a ChatML
    template: enough for text round trips and chat formatting with tiny models."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_tokens = sorted(alphabet, key=lambda c: ord(c))
    vocab = {t: i for i, t in enumerate(byte_tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>")])
    tk.save(os.path.join(path, "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": template}, fh)


def make_hf_checkpoint(family: str, path: str, seed: int = 0, **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    make_hf_model(family, seed, **overrides).save_pretrained(path)
    write_byte_tokenizer(path)
    return path


def load_hf_torch(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_forward(model, ids):
    """(logits [T, V], hidden_states tuple of [T, D]) from a HF model on one sequence, float32 numpy."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


def random_prompt(rng: np.random.Generator, n: int, vocab: int = 256) -> list[int]:
    return [int(x) for x in rng.integers(0, vocab, size=n)]


def plain_and_random_dflash(cfg, weights, ids: list[int], max_new_tokens: int, max_model_len: int,
                            block_size: int = 8) -> tuple[list[int], list[int]]:
    """Greedy outputs of plain decoding and of DFlash with a random 1-layer drafter (blocks of `block_size`) on the
    same target: a lossless engine makes them equal whatever the drafter proposes."""
    import jax

    from specjax.config import EngineConfig
    from specjax.drafter.loader import drafter_config_for, init_drafter
    from specjax.engine.engine import LLMEngine
    from specjax.sampling import SamplingParams
    from specjax.spec.proposer import DFlashProposer

    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=1, page_size=8)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    [ar] = LLMEngine(cfg, weights, config=config).generate([ids], params)
    dcfg = drafter_config_for(cfg, num_layers=1, block_size=block_size)
    dw = init_drafter(dcfg, jax.random.PRNGKey(0))
    [spec] = LLMEngine(cfg, weights, DFlashProposer(dcfg, block_size), dw, config).generate([ids], params)
    return ar.output_ids, spec.output_ids


class NoisyOracle(HostProposer):
    """Host proposer that knows plain greedy's (or seeded sampling's) continuation and corrupts each draft with
    probability `noise`: every accepted length 0..K occurs, so the acceptance and rollback paths all run."""

    name = "noisy-oracle"

    def __init__(self, prompts, outs, k, seed=0, noise=0.35):
        self.full = {tuple(p): p + o for p, o in zip(prompts, outs)}
        self.max_draft_tokens = k
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    def host_propose(self, token_ids, k):
        full = next(f for p, f in self.full.items() if tuple(token_ids[:len(p)]) == p)
        truth = full[len(token_ids):len(token_ids) + k]
        return [t if self.rng.random() > self.noise else (t + 1) % 256 for t in truth]


def in_ci(environ=os.environ) -> bool:
    """Whether this run is CI's (the environment variable CI set, as CI services set it; "0" / "false" = not)."""
    return environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str) -> None:
    """A real-weight checkpoint or a reference package the suite needs is not installed: the test is skipped on a
    developer's machine, and fails where CI is set (a CI run without the SmolLM2 weights or the `dflash` reference
    must be red, not green with its most telling tests skipped)."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: a missing test dependency fails instead of skipping)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def import_or_missing(module: str):
    """`pytest.importorskip`, except that under CI a missing module fails (`missing`)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(f"could not import {module}: {e}")


def kernel_builds() -> list[str]:
    """The kernel builds this CPU runs (specjax.kernels.isa_flags): its native one, and on an AVX-512 CPU the AVX2
    one too (what a user of an AVX2-only CPU gets)."""
    from specjax.kernels import cpu_flags, simd_isa

    flags = cpu_flags()
    return ["native"] + (["AVX2"] if simd_isa(flags) == "AVX-512F" and {"avx2", "fma"} <= set(flags.split()) else [])


def kernels_expected() -> bool:
    """Whether specjax's CPU kernels must build and run here (AVX-512F or AVX2 + FMA, a C++ compiler, not
    disabled)."""
    import shutil

    from specjax.kernels import cpu_flags, simd_isa

    return (simd_isa(cpu_flags()) is not None and bool(os.environ.get("CXX") or shutil.which("g++"))
            and os.environ.get("SPECJAX_KERNELS", "1") != "0")


def native_kernels(isa: str | None = None):
    """specjax's registered CPU kernels (kernels.QuantKernels) of one build (`kernel_builds`; None: the one users
    get); skips where they
    cannot run, fails where they should (a kernel that stops compiling must fail, not skip)."""
    from specjax.kernels import quant_kernels

    k = quant_kernels(isa)
    if k is None:
        if kernels_expected():
            pytest.fail(f"the quantized CPU kernels ({isa or 'default'} build) did not build on a CPU with AVX-512F or "
                        "AVX2 + FMA and a C++ compiler (the logged warning says why)")
        pytest.skip("this machine has neither AVX-512F nor AVX2 + FMA, or no C++ compiler")
    return k


def native_attention_kernel() -> str:
    """The registered target of the in-place paged-attention CPU kernel (see `native_kernels`)."""
    return native_kernels().attention


def write_gguf_from_hf(hf_dir: str, out_path: str, quant: str | None = None) -> None:
    """Write a GGUF of a tiny HF checkpoint the way llama.cpp's converter lays it out (llama Q/K rows permuted,
    GGUF tensor names, architecture metadata, the byte-level tokenizer): float32, or with every matrix in the
    block format `quant` (Q4_0, Q4_1, Q8_0; norms and biases stay float32, as llama.cpp keeps them)."""
    import gguf
    from safetensors.numpy import load_file

    from specjax.model.loader import GGUF_TO_HF, permute_llama_qk

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = cfg["model_type"]
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    hf_to_gguf = {}
    for g, h in GGUF_TO_HF.items():
        for i in range(cfg["num_hidden_layers"]):
            hf_to_gguf[h.replace("{i}", str(i))] = g.replace("{i}", str(i))
    w = gguf.GGUFWriter(out_path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    from tokenizers import Tokenizer
    tk = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab = {**tk["model"]["vocab"], **{t["content"]: t["id"] for t in tk["added_tokens"]}}
    tokens = [f"<unused{i}>" for i in range(cfg["vocab_size"])]
    types = [1] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    for t in tk["added_tokens"]:
        types[t["id"]] = 3
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    del Tokenizer
    rope = cfg["rope_parameters"]
    if rope.get("rope_type") == "llama3":  # llama.cpp stores llama3 scaling as per-frequency divisors
        from specjax.config import RopeConfig

        scaled = RopeConfig.from_hf(cfg)
        plain = RopeConfig(theta=scaled.theta)
        w.add_tensor("rope_freqs.weight", (plain.inv_freq(head_dim) / scaled.inv_freq(head_dim)).astype(np.float32))
    for name, arr in tensors.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            arr = permute_llama_qk(arr, heads)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if quant and arr.ndim == 2:
            kind = gguf.GGMLQuantizationType[quant]
            w.add_tensor(hf_to_gguf[name], gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(hf_to_gguf[name], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def adam_losses(loss_fn, params, steps: int, lr: float = 3e-3) -> list[float]:
    """Run `steps` jitted Adam steps on `loss_fn(params) -> (loss, aux)`; the losses seen, first to last."""
    import jax
    import optax

    opt = optax.adam(lr)

    @jax.jit
    def step(p, st):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        up, st = opt.update(g, st, p)
        return optax.apply_updates(p, up), st, loss

    state, losses = opt.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return losses


def toy_store(path: str, num: int, length: int, vocab: int, prompt_len: int, seed: int):
    """A TokenStore of `num` random sequences (vocabulary 300, ids < `vocab`) with `prompt_len`-token prompts."""
    from specjax.train.store import TokenStore

    store = TokenStore(path, 300)
    rng = np.random.default_rng(seed)
    for i in range(num):
        store.append(f"s{i}", "toy", rng.integers(0, vocab, length), prompt_len, "length")
    return store


def run_cli(args: list[str], ok: bool = True):
    """`specjax ARGS` in a fresh process, as a user runs it -> (stdout, stderr).  (The suite's own process used to
    segfault compiling a train step after ~140 tests: every compiled program holds a few memory mappings and the
    suite neared the kernel's 65,530 limit; conftest.py now drops compiled programs after each test file, and
    these CLI tests keep their own process as users run them.)"""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "specjax.cli", *args], capture_output=True, text=True, timeout=600,
                          env=cpu_env())
    assert (proc.returncode == 0) == ok, proc.stderr[-3000:]
    return proc.stdout, proc.stderr
