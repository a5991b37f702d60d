"""`specjax analyze accel`: the accelerator check, one command with nothing from the network.

Random-weight targets of real shapes (Qwen3-4B, Llama-3.1-8B, SmolLM2-135M) with random drafters of the z-lab
geometries, in bfloat16: the verify-cost curve t(q)/t(1) for q = 1..1024 (the real decode step of
bench/kflat.py), the drafter's forward per block, and TPOT of plain vs DFlash decoding at fixed acceptance
(tau tokens per step), which needs no trained drafter: a DFlash step (drafter forward, verify of B tokens,
both KV commits; timed as the real fused step) costs the same whatever it accepts, so TPOT(tau) = t_step / tau
against t(1) for plain decoding.  Presets run in order under
one time budget; each preset's q values run smallest first after t(1) and t(B), and JSON is rewritten after
every measurement, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig, RopeConfig
from specjax.drafter.loader import drafter_config_for, init_drafter
from specjax.model.target import TargetLayer, TargetWeights

# name -> (target geometry, drafter geometry: layers, block size, tapped target layers, draft vocabulary)
PRESETS: dict[str, tuple[ModelConfig, dict]] = {
    "qwen3-4b": (ModelConfig(family="qwen3", vocab_size=151936, hidden_size=2560, num_layers=36, num_heads=32,
                             num_kv_heads=8, head_dim=128, intermediate_size=9728, rope=RopeConfig(theta=1e6),
                             tie_word_embeddings=True, qk_norm=True, max_position_embeddings=40960),
                 {"num_layers": 5, "block_size": 16, "target_layer_ids": (1, 9, 17, 25, 33)}),
    "llama-3.1-8b": (ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                                 num_kv_heads=8, head_dim=128, intermediate_size=14336,
                                 rope=RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0),
                                 max_position_embeddings=131072),
                     {"num_layers": 5, "block_size": 10, "target_layer_ids": (1, 8, 15, 22, 29)}),
    "smollm2-135m": (ModelConfig(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                                 num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
                                 rope=RopeConfig(theta=100000.0), tie_word_embeddings=True),
                     {"num_layers": 2, "block_size": 8, "target_layer_ids": (1, 8, 14, 20, 27),
                      "draft_vocab_size": 8192, "slot_embedding": True}),
    # the CPU dry run of the tests: the same code path at toy shapes
    "tiny": (ModelConfig(family="qwen3", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate_size=128, tie_word_embeddings=True, qk_norm=True),
             {"num_layers": 1, "block_size": 4, "target_layer_ids": (1, 2)}),
}

TAUS = (1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)


def random_target(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, std: float = 0.02) -> TargetWeights:
    """Target weights of `cfg`'s shapes drawn on the device (normal(0, std) matrices, unit norms)."""
    d, f, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size
    keys = iter(jax.random.split(key, 4 * cfg.num_layers + 2))
    normal = lambda shape: (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)  # noqa: E731
    ones = lambda n: jnp.ones((n,), dtype)  # noqa: E731
    layers = tuple(TargetLayer(
        attn_norm=ones(d), w_qkv=normal((qkv, d)), b_qkv=jnp.zeros((qkv,), dtype) if cfg.qkv_bias else None,
        q_norm=ones(cfg.head_dim) if cfg.qk_norm else None, k_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
        w_o=normal((d, cfg.q_size)), mlp_norm=ones(d), w_gate_up=normal((2 * f, d)), w_down=normal((d, f)),
    ) for _ in range(cfg.num_layers))
    return TargetWeights(embed=normal((cfg.vocab_size, d)), layers=layers, final_norm=ones(d),
                         lm_head=None if cfg.tie_word_embeddings else normal((cfg.vocab_size, d)))


def tree_bytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def dflash_tpot(t1: float, t_block: float, t_draft: float, block_size: int, taus=TAUS, step_s=None) -> dict:
    """TPOT and speedup of DFlash at fixed tau (tokens per step, <= block_size) against plain decoding, from the
    measured fused step `step_s` (else the sum t_draft + t(B))."""
    step = step_s if step_s is not None else t_draft + t_block
    rows = [{"tau": tau, "tpot_ms": 1000 * step / tau, "speedup": tau * t1 / step} for tau in taus
            if tau <= block_size]
    return {"block_size": block_size, "plain_tpot_ms": 1000 * t1, "dflash_step_ms": 1000 * step,
            "draft_plus_verify_ms": 1000 * (t_draft + t_block), "break_even_tau": step / t1, "at_tau": rows}


def check_preset(name: str, qs, context: int, repeats: int, dtype, deadline: float, record: dict, save) -> None:
    """Measure one preset into record["presets"][name]; stops adding q values once `deadline` has passed."""
    from specjax.bench.kflat import draft_costs, verify_costs
    from specjax.spec.proposer import DFlashProposer

    tcfg, dspec = PRESETS[name]
    t0 = time.perf_counter()
    tw = random_target(tcfg, jax.random.PRNGKey(0), dtype)
    dcfg = drafter_config_for(tcfg, mask_token_id=0, **dspec)
    dw = init_drafter(dcfg, jax.random.PRNGKey(1), dtype=dtype)
    if dcfg.draft_vocab_size:
        dw = dataclasses.replace(dw, draft_ids=jnp.arange(dcfg.draft_vocab_size, dtype=jnp.int32))
    block = dcfg.block_size
    out = record["presets"][name] = {
        "target": {"family": tcfg.family, "layers": tcfg.num_layers, "hidden": tcfg.hidden_size,
                   "vocab": tcfg.vocab_size, "heads": [tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim],
                   "intermediate": tcfg.intermediate_size, "weight_bytes": tree_bytes(tw)},
        "drafter": {**{k: list(v) if isinstance(v, tuple) else v for k, v in dspec.items()},
                    "weight_bytes": tree_bytes(dw)},
        "init_s": time.perf_counter() - t0, "verify": [], "complete": False}
    save()
    order = [1, block] + [q for q in sorted(qs) if q not in (1, block)]  # t(B) always: the DFlash step needs it
    for q in order:
        if q != 1 and q != block and time.perf_counter() > deadline:
            break
        t0 = time.perf_counter()
        r = verify_costs(tcfg, tw, [q], context, repeats)[0]
        r["wall_s"] = time.perf_counter() - t0  # compile + warm-up + repeats
        out["verify"].append(r)
        out["verify"].sort(key=lambda x: x["q"])
        t1 = out["verify"][0]["median_s"]
        for x in out["verify"]:
            x["ratio"] = x["median_s"] / t1
        save()
        if q == block:
            t0 = time.perf_counter()
            d = draft_costs(DFlashProposer(dcfg, block), dw, tw, context, [block], repeats)[0]
            d["wall_s"] = time.perf_counter() - t0
            out["draft"] = d
            # the real fused step (draft + verify + both commits) checks t_draft + t(B)
            t0 = time.perf_counter()
            step = verify_costs(tcfg, tw, [block], context, repeats, proposer=DFlashProposer(dcfg, block),
                                pweights=dw)[0]
            out["dflash_step"] = {**step, "wall_s": time.perf_counter() - t0}
            out["tpot"] = dflash_tpot(t1, r["median_s"], d["median_s"], block, step_s=step["median_s"])
            save()
    out["complete"] = len(out["verify"]) == len(set(order))
    save()


def run_check(presets, qs, context: int, repeats: int, dtype, budget_s: float, out_dir: str, progress=print) -> dict:
    """Run the presets in order under one time budget; writes out_dir/accel.json (and accel.png at the end)."""
    from specjax.cli.common import machine_info

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "accel.json")
    record = {"kind": "accel", "dtype": jnp.dtype(dtype).name, "context": context, "repeats": repeats,
              "budget_s": budget_s, "machine": machine_info(), "presets": {}}

    def save():
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(path + ".tmp", path)

    start = time.perf_counter()
    for i, name in enumerate(presets):
        # each preset may use an equal share of what is left, so a slow first one cannot starve the rest
        left = budget_s - (time.perf_counter() - start)
        deadline = time.perf_counter() + left / (len(presets) - i)
        check_preset(name, qs, context, repeats, dtype, deadline, record, save)
        p = record["presets"][name]
        progress(f"{name}: " + " ".join(f"t({r['q']})={1000 * r['median_s']:.2f}ms" for r in p["verify"])
                 + (f" | draft({p['draft']['block_size']})={1000 * p['draft']['median_s']:.2f}ms"
                    f" break-even tau {p['tpot']['break_even_tau']:.2f}" if "tpot" in p else ""))
        jax.clear_caches()
    record["wall_s"] = time.perf_counter() - start
    save()
    try:
        plot_accel(record, os.path.join(out_dir, "accel.png"))
    except ImportError:  # no matplotlib on this machine: the JSON holds everything
        pass
    return record


def plot_accel(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, p in record["presets"].items():
        qs = [r["q"] for r in p["verify"]]
        ax1.plot(qs, [r["ratio"] for r in p["verify"]], "o-", label=name)
        if "tpot" in p:
            rows = p["tpot"]["at_tau"]
            ax2.plot([r["tau"] for r in rows], [r["speedup"] for r in rows], "o-",
                     label=f"{name}, block {p['tpot']['block_size']}")
    ax1.axhline(1.0, ls="--", color="gray")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tokens verified in one forward (q)")
    ax1.set_ylabel("t(q) / t(1)")
    ax1.set_title(f"verify cost, {record['machine']['backend']}, {record['dtype']}, ctx {record['context']}",
                  fontsize=9)
    ax2.axhline(1.0, ls="--", color="gray")
    ax2.set_xlabel("tau (tokens per DFlash step)")
    ax2.set_ylabel("DFlash speedup over plain decoding")
    ax2.set_title("speedup at fixed acceptance = tau t(1) / (t_draft + t(B))", fontsize=9)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
