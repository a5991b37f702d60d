"""`specjax train-drafter` and `cache-features` as users run them (a process each): resume, EAGLE-3, taps from the
target as served, and the training knobs (draft vocabulary, simulated tau, --init, --grow-layers, --max-hours)."""

import json
import os

import numpy as np
import pytest

from specjax.train.features import FeatureCache
from specjax.train.store import TokenStore
from tests.helpers import run_cli, toy_store


def test_train_drafter_cli_and_resume(tiny_dirs, tmp_path):
    toy_store(str(tmp_path / "data"), 12, 70, 256, 10, seed=0)
    out = str(tmp_path / "run")
    common = ["train-drafter", "--target", tiny_dirs["qwen3"], "--data", str(tmp_path / "data"), "--out", out,
              "--layers", "1", "--block-size", "4", "--target-layer-ids", "0,2", "--batch-size", "2",
              "--num-anchors", "4", "--save-every", "2", "--eval-every", "100", "--eval-prompts", "0",
              "--compile-cache", ""]
    run_cli(common + ["--steps", "2"])
    stdout, _ = run_cli(common + ["--steps", "4", "--resume"])
    rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]  # resumed at step 2, not restarted
    assert os.path.isfile(os.path.join(out, "drafter", "model.safetensors"))
    assert os.path.isfile(os.path.join(out, "curve.png"))
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4
    # the same run from a feature cache (tap 1 = output of layer 0, tap 3 = output of layer 2)
    run_cli(["cache-features", "--target", tiny_dirs["qwen3"], "--data", str(tmp_path / "data"), "--out",
             str(tmp_path / "feats"), "--tap-indices", "1,3", "--max-len", "512", "--compile-cache", ""])
    cached_run = common[:6] + [out + "-cached"] + common[7:]
    run_cli(cached_run + ["--steps", "2", "--features", str(tmp_path / "feats")])
    cached_rows = [json.loads(line) for line in open(os.path.join(out + "-cached", "log.jsonl"))]
    assert cached_rows[0]["step"] == 2 and np.isfinite(cached_rows[0]["loss"])


def test_train_eagle3_cli(tiny_dirs, tmp_path):
    from specjax.drafter.eagle3_loader import load_eagle3
    from specjax.model.loader import load_model

    toy_store(str(tmp_path / "data"), 8, 60, 120, 10, seed=1)
    out = str(tmp_path / "e3")
    _, stderr = run_cli(["train-drafter", "--method", "eagle3", "--target", tiny_dirs["llama"], "--data",
                         str(tmp_path / "data"), "--out", out, "--target-layer-ids", "1,2,3", "--draft-vocab-size",
                         "64", "--ttt-steps", "3", "--batch-size", "2", "--steps", "3", "--save-every", "3",
                         "--eval-every", "3", "--eval-prompts", "1", "--eval-datasets", "gsm8k",
                         "--eval-max-new-tokens", "4", "--compile-cache", ""])
    cfg, w = load_eagle3(os.path.join(out, "drafter"), load_model(tiny_dirs["llama"]).config)
    assert cfg.draft_vocab_size == 64 and w.d2t is not None
    assert "draft vocabulary: 64 tokens" in stderr


def test_taps_come_from_the_target_as_inference_runs_it(tiny_dirs, tmp_path):
    """A drafter reads the taps of the target as served (a GGUF on the int16-activation kernels), so cache-features
    and train-drafter take them from that target by default; the cache records which, and a run that would read
    other taps than its cache holds is refused, naming both."""
    import jax.numpy as jnp

    from specjax.model.loader import load_model
    from specjax.train.features import build_feature_cache, target_features
    from tests.helpers import kernels_expected, write_gguf_from_hf

    path = str(tmp_path / "llama-Q4_1.gguf")  # head_dim 16: the attention kernel takes it
    write_gguf_from_hf(tiny_dirs["llama"], path, "Q4_1")
    served = load_model(path, quant_kernels=True)
    if served.kernel_activations != "int16":
        assert not kernels_expected(), "the CPU kernels did not build on a machine that has what they need"
        pytest.skip("the CPU kernels cannot run here")
    data = str(tmp_path / "data")
    toy_store(data, 4, 40, 256, 8, seed=1)
    store = TokenStore(data)
    run_cli(["cache-features", "--target", path, "--data", data, "--out", str(tmp_path / "c"), "--tap-indices",
             "1,3", "--max-len", "64", "--compile-cache", ""])
    cache = FeatureCache(str(tmp_path / "c"))
    assert cache.kernel_activations == "int16"
    toks = np.zeros((1, 64), np.int32)
    toks[0, :40] = next(iter(store.sequences()))[1]
    kernel_taps = np.asarray(target_features(served.weights, jnp.asarray(toks), served.config, (3,)))[0, :40]
    xla_taps = np.asarray(target_features(load_model(path).weights, jnp.asarray(toks), served.config, (3,)))[0, :40]
    np.testing.assert_allclose(cache.batch([0], 64, (3,))[0, :40], kernel_taps, rtol=2e-3, atol=2e-3)
    assert np.abs(kernel_taps - xla_taps).max() > 0  # int16 activations: other taps than XLA's float32 forward
    with pytest.raises(ValueError, match="other settings or data"):  # one cache holds one kind of taps
        build_feature_cache(load_model(path), store, str(tmp_path / "c"), (1, 3), max_len=64)
    common = ["train-drafter", "--target", path, "--data", data, "--layers", "1", "--block-size", "4",
              "--target-layer-ids", "0,2", "--batch-size", "2", "--num-anchors", "4", "--eval-prompts", "0",
              "--steps", "1", "--max-len", "64", "--compile-cache", "", "--features", str(tmp_path / "c")]
    _, err = run_cli(common + ["--out", str(tmp_path / "x"), "--no-quant-kernels"], ok=False)
    assert "CPU kernels with int16 activations" in err and "XLA (float32)" in err
    run_cli(common + ["--out", str(tmp_path / "run")])
    config = json.load(open(tmp_path / "run" / "train_config.json"))
    assert config["feature_kernels"] == "int16"


def cli_error(args: list[str]) -> str:
    """`specjax ARGS` that must stop on an argument error, run in this process (it stops before training, so it
    needs no process of its own) -> what it told the user."""
    import contextlib
    import io

    from specjax.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code not in (0, None)
    return f"{stop.value.code}\n{err.getvalue()}"


def test_train_drafter_draft_vocab_simulated_tau_init_and_time_limit(tiny_dirs, tmp_path):
    """The recipe's knobs end to end: a draft vocabulary, simulated tau on a held-out store, a second run that
    starts from the first drafter and appends to the same learning curve with cumulative hours, --max-hours."""
    from specjax.drafter.loader import load_drafter
    from specjax.model.loader import load_model

    toy_store(str(tmp_path / "data"), 10, 60, 150, 10, seed=0)
    toy_store(str(tmp_path / "heldout"), 3, 40, 150, 10, seed=1)
    out, curve = str(tmp_path / "run"), str(tmp_path / "curve.jsonl")
    common = ["train-drafter", "--target", tiny_dirs["qwen3"], "--data", str(tmp_path / "data"), "--layers", "1",
              "--block-size", "4", "--target-layer-ids", "0,2", "--batch-size", "2", "--num-anchors", "8",
              "--eval-prompts", "0", "--heldout", str(tmp_path / "heldout"), "--sim-every", "2", "--log", curve,
              "--compile-cache", ""]
    _, err = run_cli(common + ["--out", out, "--steps", "3", "--draft-vocab-size", "100", "--schedule", "constant"])
    assert "draft vocabulary: 100 tokens covering" in err
    cfg, w = load_drafter(os.path.join(out, "drafter"), load_model(tiny_dirs["qwen3"]).config)
    assert cfg.draft_vocab_size == 100 and cfg.has_slot_embedding and w.slot_embedding.shape == (4, 64)
    rows = [json.loads(line) for line in open(curve)]
    sims = [r for r in rows if "sim" in r]
    assert [r["step"] for r in sims] == [0, 2, 3]
    tau = sims[-1]["sim"]["all"]["tau"]
    assert len(tau) == 3 and all(1.0 <= t <= k + 1 for k, t in enumerate(tau, 1)) and tau == sorted(tau)
    assert sims[-1]["sim"]["toy"]["anchors"] == 3 * (40 - 10 - 4 + 1)
    # second run: weights from the first drafter, fresh optimizer, same curve; stops after one step on time
    out2, _ = run_cli(common + ["--out", out + "2", "--steps", "50", "--init", os.path.join(out, "drafter"),
                                "--max-hours", "1e-9", "--draft-vocab-size", "100"])
    rows2 = [json.loads(line) for line in open(curve)]
    assert rows2[:len(rows)] == rows
    new = rows2[len(rows):]
    assert [r["step"] for r in new if "loss" in r] == [1]
    assert min(r["hours"] for r in new) >= max(r["hours"] for r in rows)
    assert json.loads(out2.strip().splitlines()[-1])["steps"] == 1
    # a drafter started from target layer 3 (reads tap 3 = its input); training donates params, not the target's
    out3, _ = run_cli(common[:9] + ["--target-layer-ids", "2"] + common[11:] + [
        "--out", out + "3", "--steps", "2", "--init-target-layers", "3", "--draft-vocab-size", "0"])
    assert json.loads(out3.strip().splitlines()[-1])["steps"] == 2
    # --grow-layers: the first drafter plus an identity layer simulates exactly its tau at step 0, then trains
    # (with --distill: online features then carry the target's last layer, hidden state 4, for the teacher)
    curve4 = str(tmp_path / "curve4.jsonl")
    out4, _ = run_cli(common[:-4] + ["--log", curve4, "--compile-cache", "", "--out", out + "4", "--steps", "1",
                                     "--init", os.path.join(out, "drafter"), "--grow-layers", "1",
                                     "--draft-vocab-size", "100", "--distill", "0.5"])
    assert json.load(open(os.path.join(out + "4", "train_config.json")))["train"]["distill"] == 0.5
    grown = [r for r in map(json.loads, open(curve4)) if "sim" in r]
    assert grown[0]["step"] == 0 and grown[0]["sim"]["all"]["tau"] == tau
    assert json.loads(out4.strip().splitlines()[-1])["steps"] == 1
    assert load_drafter(os.path.join(out + "4", "drafter"), load_model(tiny_dirs["qwen3"]).config)[0].num_layers == 2
    # a smaller block from --init keeps its first slots: trained for dflash@2 it drafts what the block-4 drafter
    # drafts there, as simulated tau at block 3 shows for both (the engine's block for K = 2)
    curve7, curve8 = str(tmp_path / "curve7.jsonl"), str(tmp_path / "curve8.jsonl")
    init = ["--init", os.path.join(out, "drafter"), "--draft-vocab-size", "100", "--steps", "0",
            "--draft-vocab-data", str(tmp_path / "heldout")]  # the vocabulary of another store, for both
    _, err = run_cli(common[:-4] + ["--log", curve7, "--compile-cache", "", "--out", out + "7", "--block-size", "3"]
                     + init)
    assert f"of the response tokens of {tmp_path / 'heldout'}" in err
    run_cli(common[:-4] + ["--log", curve8, "--compile-cache", "", "--out", out + "8", "--sim-block-size", "3"] + init)
    cut, at3 = ([r for r in map(json.loads, open(c)) if "sim" in r][0] for c in (curve7, curve8))
    assert cut["sim_block"] == at3["sim_block"] == 3 and cut["sim"] == at3["sim"]
    assert len(cut["sim"]["all"]["tau"]) == 2 and cut["sim"]["toy"]["anchors"] == 3 * (40 - 10 - 3 + 1)
    cfg7, w7 = load_drafter(os.path.join(out + "7", "drafter"), load_model(tiny_dirs["qwen3"]).config)
    assert cfg7.block_size == 3 and w7.slot_embedding.shape == (3, 64)
    np.testing.assert_array_equal(np.asarray(w7.slot_embedding), np.asarray(w.slot_embedding)[:3])
    err = cli_error(common + ["--out", out + "9", "--init", os.path.join(out, "drafter"), "--block-size", "5"])
    assert "--block-size 5 exceeds the --init drafter's 4" in err
    err = cli_error(common + ["--out", out + "10", "--sim-block-size", "5"])
    assert "--sim-block-size 5 must be in [2, the training block 4]" in err
    err = cli_error(common + ["--out", out + "5", "--grow-layers", "1"])
    assert "--grow-layers appends layers to a DFlash --init drafter" in err
    err = cli_error(common + ["--out", out + "6", "--distill", "1.5"])
    assert "--distill 1.5 needs --method dflash and 0 <= weight <= 1" in err
    # the prompt's tokens outside the draft vocabulary trained beside it (simulated tau scores them by default)
    run_cli(common + ["--out", out + "11", "--steps", "2", "--draft-vocab-size", "100", "--context-vocab", "8"])
    config11 = json.load(open(os.path.join(out + "11", "train_config.json")))
    assert config11["context_vocab"] == 8 and config11["sim_context_vocab"] == 32
    assert [r["sim_context_vocab"] for r in map(json.loads, open(curve)) if "sim" in r][-1] == 32
    err = cli_error(common + ["--out", out + "12", "--draft-vocab-size", "100", "--context-vocab", "8", "--distill",
                              "0.5"])
    assert "--distill covers the draft vocabulary only" in err
    err = cli_error(common + ["--out", out + "13", "--draft-vocab-size", "0", "--context-vocab", "8"])
    assert "--context-vocab scores tokens outside a draft vocabulary" in err
