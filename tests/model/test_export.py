"""`specjax export`: a GGUF (or HF) target written as a HF directory that transformers loads to the same logits."""

import numpy as np
import torch

from specjax.cli import main
from specjax.model.loader import load_model
from specjax.spec.reference import full_forward
from tests.helpers import load_hf_torch, random_prompt, write_gguf_from_hf


def test_export_gguf_target_to_transformers(tiny_dirs, tmp_path, capsys):
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf_from_hf(tiny_dirs["qwen2"], gguf_path)
    out = str(tmp_path / "hf")
    assert main(["export", "--model", gguf_path, "--out", out]) == 0
    assert "exported" in capsys.readouterr().out
    ours = load_model(gguf_path)
    ids = random_prompt(np.random.default_rng(3), 15)
    with torch.no_grad():
        ref = load_hf_torch(out)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(full_forward(ours.weights, ours.config, ids)[0], ref, atol=2e-4, rtol=1e-4)
    again = load_model(out)  # and specjax reads its own export back, tokenizer and chat template included
    assert again.tokenizer.encode("hello") == ours.tokenizer.encode("hello")
