"""The drafter training loop (`train_drafter`): batches from a TokenStore, target features (online or from a
FeatureCache), one `train_step` per batch, and four periodic actions, each at its own interval: a log row
(cfg.log_every), a resumable checkpoint (cfg.save_every), simulated tau on held-out answers (cfg.sim_every) and tau
with the real speculative engine (cfg.eval_every).  The parts live beside it: config.py (TrainConfig), batches.py,
features.py (taps), drafter_init.py, optimizer.py (the update step), methods.py (DFlash, EAGLE-3), checkpoint.py,
evaluate.py, simtau.py and curves.py (logs and plots).

Target features: online (one frozen-target forward per batch) or read from a `specjax cache-features` cache.
On the 2-core CPU with SmolLM2 the forward is about half of an online step (see train/features.py), so the
cache roughly doubles training throughput once built and is shared by the DFlash and EAGLE-3 runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from functools import partial

import jax
import jax.numpy as jnp

from specjax.train.batches import SequenceBatches
from specjax.train.checkpoint import load_best, load_checkpoint, save_best, save_checkpoint
from specjax.train.config import TrainConfig
from specjax.train.curves import append_row, last_hours, plot_curves, plot_sim_curves
from specjax.train.drafter_init import tap_statistics
from specjax.train.features import batch_features
from specjax.train.methods import effective_context_vocab
from specjax.train.optimizer import make_optimizer, time_scale, train_step
from specjax.train.store import TokenStore

log = logging.getLogger(__name__)


def write_train_config(out_dir: str, method, cfg: TrainConfig, store, batches: SequenceBatches, features,
                       init_from: str | None, served, mesh) -> None:
    """out_dir/train_config.json: the method, the settings, the data and features a run trained on."""
    with open(os.path.join(out_dir, "train_config.json"), "w") as fh:
        json.dump({"method": method.name, "train": dataclasses.asdict(cfg), "data": store.path,
                   "features": features.path if features is not None else "online", "init_from": init_from,
                   "feature_kernels": served.kernel_activations,
                   "context_vocab": effective_context_vocab(method),
                   "sim_context_vocab": effective_context_vocab(method, True),
                   "data_sequences": len(batches.seqs), "data_tokens": batches.num_tokens,
                   "data_parallel_devices": [str(d) for d in (mesh.devices.flat if mesh is not None else [])]},
                  fh, indent=1)


def train_drafter(target, store: TokenStore, out_dir: str, method, cfg: TrainConfig, resume: bool,
                  eval_sets: dict[str, list[list[int]]], eval_max_new_tokens: int = 96, save_dtype: str = "float32",
                  show_progress: bool = True, features=None, init_from: str | None = None, heldout=None,
                  log_path: str | None = None, mesh=None, feature_target=None) -> dict:
    """Train (or resume) a drafter for `target`; writes out_dir/{drafter,checkpoint,log.jsonl,curve.png}.

    With `cfg.keep_best`, also out_dir/best-drafter and best.json: the drafter of the highest simulated tau (all
    held-out sources, the longest K) seen by this run, for runs that outlast their data (many epochs overfit).

    `features`: an optional FeatureCache over `store` holding the method's taps (checked before training).
    `init_from`: start from this drafter checkpoint's weights (fresh optimizer state) instead of a random init.
    `heldout`: a HeldOutSet for simulated tau every `cfg.sim_every` steps.  `log_path`: a learning-curve log
    that is always appended to, with cumulative wall-clock hours, so one curve spans many runs (default
    out_dir/log.jsonl, reset by a fresh run, appended to by --resume and --init).  `mesh`: data parallelism,
    each batch split over the mesh's devices (the drafter, optimizer state and frozen target arrays replicated;
    XLA reduces the gradients), the same losses as one device up to float rounding.  `feature_target`: the target
    whose forward gives the online taps and runs the evaluations, when it is not `target` (e.g. the same GGUF on
    the CPU kernels, as inference runs it: its taps are what the drafter reads there); `target` gives the frozen
    embedding and head.
    """
    from tqdm import tqdm

    from specjax.parallel import mesh_size, replicate, shard_batch

    if cfg.keep_best and heldout is None:
        raise ValueError("--keep-best picks the drafter by simulated tau on held-out answers: give --heldout")
    if cfg.batch_size % mesh_size(mesh):
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of the {mesh_size(mesh)} data-parallel "
                         "devices")
    os.makedirs(out_dir, exist_ok=True)
    batches = SequenceBatches(store, cfg)
    optimizer, schedule = make_optimizer(cfg)
    tcfg = target.config
    if features is not None:
        features.check(store, method.tap_indices, tcfg.hidden_size, cfg.max_len)
    served = feature_target if feature_target is not None else target
    tap_rms = None if init_from else tap_statistics(served, batches, method.tap_indices, cache=features)
    params = method.load(init_from, tcfg) if init_from else method.init_params(jax.random.PRNGKey(cfg.seed), target,
                                                                                tap_rms)
    opt_state = optimizer.init(params)
    step0, summary = 0, {}
    shared_log = log_path is not None  # an explicit learning-curve log is always appended to, never reset
    log_path = log_path or os.path.join(out_dir, "log.jsonl")
    if resume and os.path.isdir(os.path.join(out_dir, "checkpoint")):
        params, opt_state, step0 = load_checkpoint(out_dir, method, tcfg, opt_state)
        best = load_best(out_dir) if cfg.keep_best else None
        if best is not None:
            summary["best"] = best  # a resumed run keeps the best of the runs before it
        log.info("resumed from step %d", step0)
    elif os.path.exists(log_path) and not init_from and not shared_log:
        os.remove(log_path)
    hours0 = last_hours(log_path)
    write_train_config(out_dir, method, cfg, store, batches, features, init_from, served, mesh)
    consts = method.constants(target)
    eval_consts = consts  # evaluation runs on one device (the engine and the held-out set live there)
    params, opt_state, consts = replicate((params, opt_state, consts), mesh)
    bar = tqdm(total=cfg.steps, initial=step0, unit="step", dynamic_ncols=True, disable=not show_progress)
    t_start, tokens_seen = time.perf_counter(), 0

    write = partial(append_row, log_path)

    def on_one_device(p):
        return p if mesh is None else jax.device_put(p, jax.devices()[0])

    def simulate(step):
        sim = heldout.evaluate(method, on_one_device(params), eval_consts)
        write({"step": step, "hours": hours0 + (time.perf_counter() - t_start) / 3600, "sim": sim,
               "sim_block": method.sim_span, "sim_context_vocab": effective_context_vocab(method, True)})
        bar.write(f"step {step}: simulated tau(K={len(sim['all']['tau'])}) = {sim['all']['tau'][-1]:.3f}, "
                  f"tau(3) = {sim['all']['tau'][min(2, len(sim['all']['tau']) - 1)]:.3f}")
        summary["sim"] = sim
        tau = sim["all"]["tau"][-1]
        if cfg.keep_best and tau > summary.get("best", {}).get("tau", -1.0):
            summary["best"] = {"step": step, "tau": tau, "hours": hours0 + (time.perf_counter() - t_start) / 3600}
            save_best(out_dir, method, on_one_device(params), summary["best"], save_dtype)

    if heldout is not None and cfg.sim_every and step0 == 0:
        simulate(0)
    done = step0  # steps completed (a run with --steps at or below the checkpoint's only saves the drafter)
    deadline = t_start + cfg.max_hours * 3600 if cfg.max_hours is not None else None
    t_first = None  # end of this run's first step: the cosine-time schedule runs from there to the deadline
    for step in range(step0, cfg.steps):
        tokens, mask, lengths, epoch, idx = batches.batch(step)
        extra = method.host_inputs((cfg.seed, step), tokens, mask, lengths)
        taps = batch_features(served, tokens, idx, method.tap_indices, features)
        inputs = shard_batch((jnp.asarray(tokens), taps, jnp.asarray(mask), jnp.asarray(lengths), extra), mesh)
        scale = 1.0
        if cfg.schedule == "cosine-time":
            now = time.perf_counter()
            scale = time_scale(cfg, 0.0 if t_first is None else (now - t_first) / max(1e-9, deadline - t_first))
        params, opt_state, loss, aux, gnorm = train_step(params, opt_state, consts, *inputs,
                                                         jnp.float32(scale), method=method, optimizer=optimizer)
        tokens_seen += int(lengths.sum())
        done = step + 1
        if t_first is None and cfg.schedule == "cosine-time":
            jax.block_until_ready(loss)  # once: the schedule's clock starts after the first step's compile
            t_first = time.perf_counter()
        elapsed = time.perf_counter() - t_start
        out_of_time = deadline is not None and time.perf_counter() >= deadline
        last = step + 1 == cfg.steps or out_of_time
        if (step + 1) % cfg.log_every == 0 or last:
            loss_v, acc_v = float(loss), float(aux["acc"])
            row = {"step": step + 1, "epoch": epoch, "loss": loss_v, "acc": acc_v, "grad_norm": float(gnorm),
                   "lr": float(schedule(step)) * scale,
                   "acc_per_slot": [round(float(a), 4) for a in aux["acc_per_slot"]],
                   "tokens_per_s": tokens_seen / elapsed, "elapsed_s": elapsed, "hours": hours0 + elapsed / 3600}
            write(row)
            bar.set_postfix(loss=f"{loss_v:.3f}", acc=f"{acc_v:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        bar.update(1)
        if (step + 1) % cfg.save_every == 0 or last:
            save_checkpoint(out_dir, step + 1, method, params, opt_state, cfg)
        if heldout is not None and cfg.sim_every and ((step + 1) % cfg.sim_every == 0 or last):
            simulate(step + 1)
        if eval_sets and ((step + 1) % cfg.eval_every == 0 or last):
            ev = {name: method.evaluate(served, on_one_device(params), prompts, eval_max_new_tokens)
                  for name, prompts in eval_sets.items()}
            write({"step": step + 1, "hours": hours0 + (time.perf_counter() - t_start) / 3600, "eval": ev})
            bar.write(f"step {step + 1}: " + ", ".join(f"tau[{k}]={v['tau']:.2f}" for k, v in ev.items()))
            summary["eval"] = ev
            plot_curves(log_path, os.path.join(out_dir, "curve.png"))
        if out_of_time:
            bar.write(f"stopping at step {step + 1}: --max-hours {cfg.max_hours} reached")
            break
    bar.close()
    method.save(os.path.join(out_dir, "drafter"), params, dtype=save_dtype)
    if os.path.exists(log_path):  # a run of 0 steps (re-saving a drafter) has nothing to plot
        plot_curves(log_path, os.path.join(out_dir, "curve.png"))
    if heldout is not None and cfg.sim_every:
        plot_sim_curves({method.name: log_path}, os.path.join(out_dir, "sim-curve.png"),
                        "simulated tau on held-out target answers")
    summary.update({"steps": done, "wall_s": time.perf_counter() - t_start, "tokens_seen": tokens_seen,
                    "data_sequences": len(batches.seqs), "data_tokens": batches.num_tokens})
    return summary
