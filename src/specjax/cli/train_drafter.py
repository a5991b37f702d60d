"""`specjax train-drafter`: train (or resume) a DFlash or EAGLE-3 drafter on a token store; the checks of its
arguments, the drafter's configuration and draft vocabulary, then train/trainer.py's loop."""

from __future__ import annotations

import argparse
import json
import sys

from specjax.cli.common import DEFAULT_CACHE, add_quant_kernel_arg, enable_compile_cache
from specjax.config import EngineConfig
from specjax.train.draft_vocab import background_counts, draft_vocabulary


def served_target(args, target):
    """The target as inference runs it (`--quant-kernels`: a GGUF's blocks on the CPU kernels, with
    `--kernel-activations`), whose taps a drafter reads at inference; `target` itself where no kernels run it."""
    from specjax.kernels import quant_kernels
    from specjax.llm import DTYPES
    from specjax.model.loader import load_model

    if not (args.quant_kernels and target.source.endswith(".gguf") and quant_kernels() is not None):
        return target  # no GGUF blocks, or no kernels here (another backend): the same forward as `target`
    served = load_model(args.target, DTYPES["float32"], quant_kernels=True, activations=args.kernel_activations)
    return served if served.quantized_kernels else target


def cmd_train_drafter(args) -> int:
    from specjax.datasets import load_eval
    from specjax.drafter.loader import drafter_config_for
    from specjax.llm import DTYPES
    from specjax.model.loader import load_model
    from specjax.parallel import data_parallel_mesh
    from specjax.train.config import TrainConfig
    from specjax.train.methods import DFlashMethod, Eagle3Method
    from specjax.train.store import StoreUnion, TokenStore, open_stores
    from specjax.train.trainer import train_drafter

    if args.dpace_alpha is not None and (args.method != "dflash" or not 0.0 < args.dpace_alpha <= 1.0):
        raise SystemExit(f"error: --dpace-alpha {args.dpace_alpha} needs --method dflash and 0 < alpha <= 1")
    if not 0.0 <= args.distill <= 1.0 or (args.distill and args.method != "dflash"):
        raise SystemExit(f"error: --distill {args.distill} needs --method dflash and 0 <= weight <= 1")
    if args.grow_layers < 0:
        raise SystemExit(f"error: --grow-layers must be >= 0, got {args.grow_layers}")
    if args.grow_layers and not (args.method == "dflash" and args.init):
        raise SystemExit("error: --grow-layers appends layers to a DFlash --init drafter; name one with --init")
    if args.grown_lr_scale <= 0 or (args.grown_lr_scale != 1.0 and not args.grow_layers):
        raise SystemExit(f"error: --grown-lr-scale {args.grown_lr_scale} needs --grow-layers and a positive value")
    if args.block_size is not None and args.block_size < 2:
        raise SystemExit(f"error: --block-size must be >= 2, got {args.block_size}")
    try:  # TrainConfig checks its own settings (e.g. cosine-time needs --max-hours)
        cfg = TrainConfig(block_size=args.block_size or 16, batch_size=args.batch_size, num_anchors=args.num_anchors,
                          max_len=args.max_len, steps=args.steps, lr=args.lr, warmup_ratio=args.warmup_ratio,
                          weight_decay=args.weight_decay, gamma=args.gamma, dpace_alpha=args.dpace_alpha,
                          seed=args.seed, distill=args.distill, save_every=args.save_every,
                          eval_every=args.eval_every, schedule=args.schedule, optimizer=args.optimizer,
                          max_hours=args.max_hours, sim_every=args.sim_every, log_every=args.log_every,
                          grown_layers=args.grow_layers, grown_lr_scale=args.grown_lr_scale,
                          pad_multiple=args.pad_multiple, keep_best=args.keep_best)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.keep_best and not args.heldout:
        raise SystemExit("error: --keep-best picks the drafter by simulated tau on held-out answers: give --heldout")
    try:
        store = open_stores(args.data)
    except ValueError as e:
        raise SystemExit(f"error: --data: {e}") from None
    if args.features and isinstance(store, StoreUnion):
        raise SystemExit("error: --features caches one store's taps: train on several --data stores with online "
                         "features (no --features), or merge the stores and their caches first "
                         "(specjax.train.merge.merge_stores)")
    enable_compile_cache(args.compile_cache)
    target = load_model(args.target, DTYPES["float32"])
    ids = tuple(int(x) for x in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    if args.sim_block_size is not None and args.method != "dflash":
        raise SystemExit("error: --sim-block-size is for --method dflash")
    vocab = target.config.vocab_size
    draft_ids, coverage = None, 1.0
    if 0 < args.draft_vocab_size < vocab:
        background = None
        if args.draft_vocab_text and target.tokenizer is not None:
            background = background_counts(target.tokenizer, vocab, args.data_dir, args.sharegpt_file)
        vocab_store = TokenStore(args.draft_vocab_data) if args.draft_vocab_data else store
        draft_ids, coverage = draft_vocabulary(vocab_store, vocab, args.draft_vocab_size, background)
    if args.method == "dflash":
        if args.init:  # the drafter's weights do not depend on the vocabulary: it is chosen anew from the data
            import dataclasses

            from specjax.drafter.loader import load_drafter

            dcfg, _ = load_drafter(args.init, target.config)
            block = args.block_size or dcfg.block_size
            if block > dcfg.block_size and dcfg.has_slot_embedding:
                raise SystemExit(f"error: --block-size {block} exceeds the --init drafter's {dcfg.block_size}: its "
                                 "slot offsets exist only for the block it was trained with")
            dcfg = dataclasses.replace(dcfg, draft_vocab_size=0 if draft_ids is None else len(draft_ids),
                                       num_layers=dcfg.num_layers + args.grow_layers, block_size=block)
            cfg = dataclasses.replace(cfg, block_size=block)
        else:
            dcfg = drafter_config_for(target.config, num_layers=args.layers, block_size=cfg.block_size,
                                      target_layer_ids=ids, num_taps=args.num_taps,
                                      intermediate_size=args.intermediate_size, mask_token_id=args.mask_token_id,
                                      slot_embedding=args.slot_embedding,
                                      draft_vocab_size=0 if draft_ids is None else len(draft_ids))
        init_layers = tuple(int(x) for x in args.init_target_layers.split(",")) if args.init_target_layers else None
        if args.context_vocab and draft_ids is None:
            raise SystemExit("error: --context-vocab scores tokens outside a draft vocabulary: give "
                             "--draft-vocab-size > 0 (or an --init drafter that has one)")
        try:
            method = DFlashMethod(dcfg, cfg.block_size, args.num_anchors, cfg.decay,
                                  draft_ids=None if draft_ids is None else tuple(int(i) for i in draft_ids),
                                  init_layers=init_layers, dpace_alpha=cfg.dpace_alpha, distill=cfg.distill,
                                  teacher_tap=target.config.num_layers, teacher_eps=target.config.rms_norm_eps,
                                  sim_block=args.sim_block_size, context_vocab=args.context_vocab,
                                  sim_context_vocab=args.sim_context_vocab)
        except ValueError as e:  # DFlashMethod checks its own settings (e.g. --sim-block-size against the block)
            raise SystemExit(f"error: {e}") from None
    else:
        from specjax.drafter.eagle3_loader import eagle3_config_for

        if args.init:
            raise SystemExit("error: --init is for DFlash drafters (EAGLE-3 runs resume with --resume)")
        if args.context_vocab:
            raise SystemExit("error: --context-vocab is for DFlash drafters (EAGLE-3 drafts from its own head)")
        if draft_ids is None:
            import numpy as np

            draft_ids = np.arange(vocab)
        ecfg = eagle3_config_for(target.config, draft_vocab_size=len(draft_ids), aux_ids=ids,
                                 intermediate_size=args.intermediate_size)
        method = Eagle3Method(ecfg, tuple(int(i) for i in draft_ids), target.config.num_layers, args.ttt_steps,
                              args.num_draft_tokens)
    if draft_ids is not None:
        print(f"draft vocabulary: {len(draft_ids)} tokens covering {100 * coverage:.2f}% of the response tokens of "
              f"{args.draft_vocab_data or args.data}",
              file=sys.stderr)
    eval_sets = {}
    if args.eval_prompts > 0 and target.tokenizer is not None:
        for name in args.eval_datasets.split(","):
            prompts = load_eval(name, args.data_dir)[: args.eval_prompts]
            eval_sets[name] = [target.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}])
                               for p in prompts]
    served = served_target(args, target)
    features = None
    if args.features:
        from specjax.train.features import FeatureCache

        features = FeatureCache(args.features)
        if features.kernel_activations != served.kernel_activations:
            def describe(a):
                return f"the CPU kernels with {a} activations" if a else "XLA (float32)"
            raise SystemExit(f"error: --features {args.features} holds taps of the target on "
                             f"{describe(features.kernel_activations)}, this run reads taps of the target on "
                             f"{describe(served.kernel_activations)}: match --quant-kernels / --kernel-activations "
                             "to the cache's, or build a cache with these")
    heldout = None
    if args.heldout:
        from specjax.train.simtau import HeldOutSet

        heldout = HeldOutSet(served, TokenStore(args.heldout), method.tap_indices, method.sim_span, cfg.max_len)
    summary = train_drafter(target, store, args.out, method, cfg, args.resume, eval_sets, args.eval_max_new_tokens,
                            args.save_dtype, features=features, init_from=args.init, heldout=heldout,
                            log_path=args.log, mesh=data_parallel_mesh(args.data_parallel_size),
                            feature_target=served)
    print(json.dumps(summary))
    return 0


def register(sub) -> None:
    t = sub.add_parser("train-drafter", help="train a DFlash drafter on target-regenerated data (resumable)")
    t.add_argument("--target", default="default")
    t.add_argument("--data", required=True, help="token store written by `specjax regenerate`, or several "
                   "separated by commas, read as one training set (e.g. greedy answers plus sampled ones)")
    t.add_argument("--out", required=True)
    t.add_argument("--method", default="dflash", choices=["dflash", "eagle3"])
    t.add_argument("--layers", type=int, default=2, help="DFlash drafter layers")
    t.add_argument("--block-size", type=int, default=None,
                   help="DFlash block, anchor included (default 16, or the --init drafter's; a smaller one than "
                        "--init's keeps its first slots)")
    t.add_argument("--sim-block-size", type=int, default=None,
                   help="DFlash: the block simulated tau drafts (default the training block; K + 1 is what "
                        "`dflash@K` drafts in the engine)")
    t.add_argument("--num-taps", type=int, default=5)
    t.add_argument("--target-layer-ids", default=None,
                   help="DFlash: target layers whose OUTPUT is tapped; EAGLE-3: hidden-state indices (layer inputs)")
    t.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="draft vocabulary: the most frequent response tokens (0 = the whole target vocabulary)")
    t.add_argument("--draft-vocab-text", action=argparse.BooleanOptionalAction, default=True,
                   help="rank tokens the data never shows by their counts in the training sources' existing "
                        "answers (tokenizer only)")
    t.add_argument("--draft-vocab-data", default=None,
                   help="token store whose responses choose the draft vocabulary (default --data; e.g. the whole "
                        "store when --data is a slice of it)")
    t.add_argument("--sharegpt-file", default=None)
    t.add_argument("--context-vocab", type=int, default=0, metavar="N",
                   help="DFlash with a draft vocabulary: also train each answer's labels among its prompt's last N "
                        "distinct tokens outside the vocabulary, scored beside it as the engine drafts them "
                        "(EngineConfig.context_vocab; 0 = the draft vocabulary only)")
    t.add_argument("--sim-context-vocab", type=int, default=EngineConfig.context_vocab, metavar="N",
                   help="simulated tau drafts with this context vocabulary, as the engine does (default %(default)s; "
                        "runs before 2026-12-07 simulated 0)")
    t.add_argument("--slot-embedding", action=argparse.BooleanOptionalAction, default=True,
                   help="DFlash: learned per-slot input offsets (optional specjax tensor; z-lab checkpoints lack it)")
    t.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 training-time-test unrolled steps")
    t.add_argument("--num-draft-tokens", type=int, default=4, help="EAGLE-3 K used by the tau evaluation")
    t.add_argument("--intermediate-size", type=int, default=None)
    t.add_argument("--mask-token-id", type=int, default=None,
                   help="reuse this target token as MASK (default: learn a drafter-owned mask embedding)")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="split each batch over this many devices (a multiple of them; gradients reduced by XLA)")
    t.add_argument("--log-every", type=int, default=10, help="steps between loss rows in the log")
    t.add_argument("--num-anchors", type=int, default=32)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--gamma", type=float, default=None, help="loss decay (default 7 for block 16, 4 for block 8)")
    t.add_argument("--dpace-alpha", type=float, default=None,
                   help="DFlash: D-PACE slot weights (from the drafter's own confidence, smoothed by this alpha, "
                        "e.g. 0.5) instead of the fixed decay")
    t.add_argument("--distill", type=float, default=0.0,
                   help="DFlash: mix this weight of KL to the target's own next-token distribution into each slot's "
                        "loss (soft labels; needs the target's last-layer output, hidden state num_layers, in "
                        "--features)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per eval dataset (0 = no eval)")
    t.add_argument("--eval-datasets", default="gsm8k,mbpp")
    t.add_argument("--eval-max-new-tokens", type=int, default=96)
    t.add_argument("--data-dir", default=None)
    t.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--resume", action="store_true", help="continue from out/checkpoint")
    t.add_argument("--init", default=None, help="DFlash: start from this drafter's weights (fresh optimizer), e.g. "
                   "the shipped one, and append to --log")
    t.add_argument("--grow-layers", type=int, default=0,
                   help="DFlash with --init: append this many layers, each starting as an identity (zero output "
                        "projections), so training starts from the init drafter's exact drafts with more capacity")
    t.add_argument("--grown-lr-scale", type=float, default=1.0,
                   help="with --grow-layers: the appended layers train at this multiple of --lr (the others at --lr)")
    t.add_argument("--init-target-layers", default=None,
                   help="DFlash: start the drafter as a copy of these target layers (one per drafter layer, e.g. "
                        "28,29; the first must be tapped: its input is a hidden-state index of the taps)")
    t.add_argument("--log", default=None, help="learning-curve log (JSON lines, cumulative hours; default "
                   "OUT/log.jsonl)")
    t.add_argument("--schedule", default="cosine", choices=["cosine", "constant", "cosine-time"],
                   help="cosine: to 0 at --steps; constant: warm-up, then flat; cosine-time: warm-up and cosine over "
                        "the wall time of --max-hours (from the end of the first step), --steps only a cap")
    t.add_argument("--pad-multiple", type=int, default=64,
                   help="pad each batch to a multiple of this many tokens (--max-len: one compiled step shape, for "
                        "accelerators where every shape compiles slowly)")
    t.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    t.add_argument("--max-hours", type=float, default=None, help="stop after this much wall time (saves first)")
    t.add_argument("--heldout", default=None, help="token store of target answers to held-out prompts: simulated "
                   "tau every --sim-every steps")
    t.add_argument("--sim-every", type=int, default=100)
    t.add_argument("--keep-best", action="store_true", help="also keep the drafter of the best simulated tau so far "
                   "(OUT/best-drafter, OUT/best.json): long runs over a small store overfit")
    t.add_argument("--features", default=None, help="feature cache from `specjax cache-features` (default: "
                   "compute target features online, one forward per batch)")
    t.add_argument("--compile-cache", default=DEFAULT_CACHE)
    add_quant_kernel_arg(t)  # online taps, simulated tau and evaluations on the target as inference runs it
    t.set_defaults(func=cmd_train_drafter)
