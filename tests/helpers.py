"""Builders for tiny random checkpoints in the real formats (HF safetensors dirs, GGUF, z-lab drafters)."""

from __future__ import annotations

import json
import os

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB = 300  # 256 byte tokens + specials + unused rows


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
