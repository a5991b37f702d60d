"""Hub names resolve through a local HF cache made here (offline, as in the suite): never the network."""

import os
import shutil

import jax
import numpy as np
import pytest

from specjax.model import hub
from specjax.model.loader import CheckpointError, load_model


def cache_snapshot(cache: str, repo: str, src: str, commit: str, ref: str = "main") -> str:
    """Lay out `src` as the HF cache does after `hf download REPO --revision REF`."""
    base = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(base, "snapshots", commit)
    shutil.copytree(src, snap)
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    with open(os.path.join(base, "refs", ref), "w") as fh:
        fh.write(commit)
    return snap


def test_hub_names_load_from_the_cache_offline(tiny_dirs, tmp_path, monkeypatch):
    from specjax.drafter.loader import drafter_config_for, init_drafter, load_drafter, save_drafter

    cache = str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main = cache_snapshot(cache, "specjax-tests/tiny-qwen3", tiny_dirs["qwen3"], "a" * 40)
    v2 = cache_snapshot(cache, "specjax-tests/tiny-qwen3", tiny_dirs["llama"], "b" * 40, ref="v2")

    assert hub.resolve("specjax-tests/tiny-qwen3") == main
    assert hub.resolve("specjax-tests/tiny-qwen3@v2") == v2
    assert hub.resolve("specjax-tests/tiny-qwen3@" + "a" * 40) == main
    target = load_model("specjax-tests/tiny-qwen3")
    direct = load_model(tiny_dirs["qwen3"])
    assert target.config == direct.config
    np.testing.assert_array_equal(np.asarray(target.weights.embed), np.asarray(direct.weights.embed))
    assert load_model("specjax-tests/tiny-qwen3@v2").config.family == "llama"

    dcfg = drafter_config_for(target.config, num_layers=1, block_size=4)
    save_drafter(str(tmp_path / "drafter"), dcfg, init_drafter(dcfg, jax.random.PRNGKey(0)))
    cache_snapshot(cache, "specjax-tests/tiny-qwen3-dflash", str(tmp_path / "drafter"), "c" * 40)
    cfg, _ = load_drafter("specjax-tests/tiny-qwen3-dflash", target.config)
    assert cfg.block_size == 4

    with pytest.raises(CheckpointError, match=r"hf download specjax-tests/missing --revision v9.*HF_HUB_CACHE"):
        load_model("specjax-tests/missing@v9")
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE=1 and it is not in the cache"):
        load_drafter("specjax-tests/missing")


def test_local_paths_win_over_hub_names(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dirs["qwen2"], "org/model")  # a relative directory that looks like a hub name
    assert not hub.is_hub_name("org/model") and hub.resolve("org/model") == "org/model"
    assert load_model("org/model").config.family == "qwen2"
    assert not hub.is_hub_name("./x/y") and not hub.is_hub_name("/abs/path") and not hub.is_hub_name("a/b/c")
    assert hub.is_hub_name("Qwen/Qwen3-8B") and hub.is_hub_name("z-lab/Qwen3-8B-DFlash-b16@main")
