"""`specjax analyze numerics` (bench/numerics.py): its statistics on hand-made logits, the role ablation's swap of
kernel targets, and the command end to end on a tiny Q4_1 GGUF."""

import json

import numpy as np
import pytest

from specjax.bench.numerics import ROLES, compare, pool, with_activations
from specjax.model.quant import QuantMatrix
from tests.helpers import kernels_expected, toy_store, write_gguf_from_hf


def test_statistics_of_hand_made_logits():
    ref = np.array([[4.0, 1.0, 0.0], [2.0, 1.8, 0.0], [0.0, 3.0, 1.0]], np.float32)
    same = compare(ref, ref, np.array([0, 1, 1]))
    assert same["kl_sum"] == pytest.approx(0.0, abs=1e-12) and same["agree"] == 3
    assert same["clear"] == 2  # row 1's top-2 gap is 0.2: a near-tie
    flipped = ref.copy()
    flipped[1] = [1.8, 2.0, 0.0]  # the near-tie flips: top-1 differs where the gap is not clear
    got = pool([compare(ref, flipped, np.array([0, 1, 1])), same])
    assert got["positions"] == 6 and got["top1_agreement"] == pytest.approx(5 / 6)
    assert got["top1_agreement_clear"] == 1.0 and got["clear_positions"] == 4
    lp = ref[1] - np.log(np.exp(ref[1].astype(np.float64)).sum())
    lq = flipped[1] - np.log(np.exp(flipped[1].astype(np.float64)).sum())
    assert got["kl"] == pytest.approx(np.sum(np.exp(lp) * (lp - lq)) / 6, rel=1e-6)
    assert got["perplexity"] < got["float32_perplexity"]  # row 1's label (1) gained probability


def test_greedy_agreement_counts_partings_against_the_reference():
    """Equal answers, a parting at token 0 and one later, against the reference engine (named apart from the
    float32-activation kernels' variant, which once replaced it in the report)."""
    from types import SimpleNamespace

    from specjax.bench.numerics import REFERENCE, greedy_agreement

    class Fake:
        def __init__(self, answers):
            self.answers = answers

        def generate(self, prompts, params):
            return [SimpleNamespace(token_ids=a) for a in self.answers]

    llms = {REFERENCE: Fake([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), "float32": Fake([[1, 2, 3], [4, 5, 6], [7, 8, 9]]),
            "int8": Fake([[1, 2, 3], [0, 5, 6], [7, 8, 0]])}
    report = greedy_agreement(llms, REFERENCE, [[0]] * 3, None)
    assert report["float32"]["equal"] == 3 and report[REFERENCE]["equal"] == 3
    assert report["int8"] == {"prompts": 3, "equal": 1, "first_token_differs": 1, "median_first_parting": 1.0,
                              "partings": [None, 0, 2]}


def test_role_ablation_swaps_only_that_roles_kernels(tiny_dirs, tmp_path):
    from specjax.kernels import quant_kernels
    from specjax.model.loader import load_model

    path = str(tmp_path / "llama-Q4_1.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    model = load_model(path, quant_kernels=True)
    if model.kernel_activations != "int16":
        assert not kernels_expected(), "the CPU kernels did not build on a machine that has what they need"
        pytest.skip("the CPU kernels cannot run here")
    kernels = quant_kernels()
    swapped = with_activations(model.weights, ["w_down", "head"], "int8", kernels)
    layer = swapped.layers[0]
    assert layer.w_down.activations == "int8" and layer.w_down.target == kernels.block_targets("int8")["Q4_1"]
    assert all(getattr(layer, r).activations == "int16" for r in ROLES if r not in ("w_down", "head"))
    head = swapped.head_blocks
    assert isinstance(head, QuantMatrix) and head.activations == "int8"


@pytest.mark.slow
def test_analyze_numerics_command_on_a_tiny_gguf(tiny_dirs, tmp_path, capsys):
    """The command end to end: float32 XLA against the kernels' int16 and int8 activations, teacher-forced over a
    token store, with greedy agreement skipped (no chat prompts for a toy tokenizer): int16 is the closer."""
    from specjax.cli import main
    from specjax.model.loader import load_model

    path = str(tmp_path / "llama-Q4_1.gguf")
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    if load_model(path, quant_kernels=True).kernel_activations != "int16":
        assert not kernels_expected(), "the CPU kernels did not build on a machine that has what they need"
        pytest.skip("the CPU kernels cannot run here")
    toy_store(str(tmp_path / "store"), 3, 40, 256, 8, seed=2)
    out = tmp_path / "numerics.json"
    assert main(["analyze", "numerics", "--model", path, "--variants", "int16,int8", "--answers", "3", "--plain",
                 "0", "--greedy-prompts", "0", "--store", str(tmp_path / "store"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    stats = {name: kinds["answers"] for name, kinds in report["teacher_forced"].items()}
    assert stats["int16"]["positions"] == 3 * 32  # the answers' positions, after each 8-token prompt
    assert 0 < stats["int16"]["kl"] < stats["int8"]["kl"] / 100
    assert "int16" in capsys.readouterr().out
    assert main(["analyze", "numerics", "--model", path, "--variants", "int16,fp8"]) == 2
    assert "unknown kernel activations fp8" in capsys.readouterr().err
