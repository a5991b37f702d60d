"""`specjax analyze accel`: the CPU dry run of the accelerator check at toy shapes, its budget rule, and the real
geometries of its presets (checked by shape only, nothing allocated)."""

import json

import jax
import pytest

from specjax.bench.accel import PRESETS, random_target
from specjax.cli import main


def test_accel_dry_run_at_tiny_shapes(tmp_path, capsys):
    out = tmp_path / "accel"
    assert main(["analyze", "accel", "--presets", "tiny", "--q", "1,2,8", "--repeats", "2", "--dtype", "float32",
                 "--budget-s", "600", "--out-dir", str(out)]) == 0
    assert '"tiny"' in capsys.readouterr().out
    p = json.loads((out / "accel.json").read_text())["presets"]["tiny"]
    assert [r["q"] for r in p["verify"]] == [1, 2, 4, 8] and p["complete"]  # the drafter's block (4) is always timed
    assert p["verify"][0]["ratio"] == 1.0 and all(r["median_s"] > 0 for r in p["verify"])
    assert p["draft"]["block_size"] == 4 and p["dflash_step"]["q"] == 4
    t1, step = p["verify"][0]["median_s"], p["dflash_step"]["median_s"]
    rows = p["tpot"]["at_tau"]
    assert [r["tau"] for r in rows] == [1.5, 2.0, 3.0, 4.0]  # tau never exceeds the block
    assert all(r["speedup"] == pytest.approx(r["tau"] * t1 / step) for r in rows)
    assert p["tpot"]["break_even_tau"] == pytest.approx(step / t1)
    assert (out / "accel.png").exists()


def test_accel_budget_keeps_t1_the_block_and_the_drafter(tmp_path):
    out = tmp_path / "accel"
    assert main(["analyze", "accel", "--presets", "tiny", "--q", "1,2,8,16", "--repeats", "1", "--dtype", "float32",
                 "--budget-s", "0", "--out-dir", str(out)]) == 0
    p = json.loads((out / "accel.json").read_text())["presets"]["tiny"]
    assert [r["q"] for r in p["verify"]] == [1, 4] and not p["complete"] and "tpot" in p


def test_accel_rejects_an_unknown_preset(tmp_path, capsys):
    assert main(["analyze", "accel", "--presets", "tiny,qwen9", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "qwen9" in err and "qwen3-4b" in err


@pytest.mark.parametrize("name,params", [("qwen3-4b", 4_022_468_096), ("llama-3.1-8b", 8_030_261_248),
                                         ("smollm2-135m", 134_515_008)])
def test_presets_have_the_real_parameter_counts(name, params):
    cfg, _ = PRESETS[name]
    shapes = jax.eval_shape(lambda: random_target(cfg, jax.random.PRNGKey(0)))
    assert sum(a.size for a in jax.tree_util.tree_leaves(shapes)) == params
