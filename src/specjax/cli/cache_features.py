"""`specjax cache-features`: run the frozen target once over a token store and cache its taps for training."""

from __future__ import annotations

import json

from specjax.cli.common import DEFAULT_CACHE, add_quant_kernel_arg, enable_compile_cache


def cmd_cache_features(args) -> int:
    from tqdm import tqdm

    from specjax.config import default_target_layer_ids
    from specjax.drafter.eagle3_loader import default_aux_ids
    from specjax.llm import DTYPES
    from specjax.model.loader import load_model
    from specjax.parallel import data_parallel_mesh, tensor_parallel_mesh
    from specjax.train.features import build_feature_cache
    from specjax.train.store import TokenStore

    enable_compile_cache(args.compile_cache)
    if args.tensor_parallel_size > 1 and args.data_parallel_size > 1:
        raise SystemExit("error: cache-features splits either the target (--tensor-parallel-size) or the batch "
                         "(--data-parallel-size), not both")
    target = load_model(args.target, DTYPES["float32"], tensor_parallel_mesh(args.tensor_parallel_size),
                        quant_kernels=args.quant_kernels, activations=args.kernel_activations)
    if target.quantized_kernels and args.data_parallel_size > 1:
        raise SystemExit("error: the CPU kernels run the target on one device; --data-parallel-size needs "
                         "--no-quant-kernels")
    n = target.config.num_layers
    if args.tap_indices:
        taps = tuple(int(x) for x in args.tap_indices.split(","))
    else:  # what default DFlash (--num-taps) and EAGLE-3 drafters of this target read
        taps = tuple(i + 1 for i in default_target_layer_ids(n, min(args.num_taps, n))) + tuple(default_aux_ids(n))
    bad = [i for i in taps if not 0 <= i <= n]
    if bad:
        raise SystemExit(f"error: tap indices {bad} out of range 0..{n} (hidden-state index i = output of layer i-1)")
    store = TokenStore(args.data)
    bar = tqdm(total=len(store), unit="seq", dynamic_ncols=True)

    def progress(done, total):
        bar.update(done - bar.n)

    cache = build_feature_cache(target, store, args.out, taps, args.max_len, args.batch_tokens, progress,
                                mesh=data_parallel_mesh(args.data_parallel_size))
    bar.close()
    print(json.dumps({"out": args.out, "tap_indices": cache.tap_indices, "rows": int(cache.lengths.sum()),
                      "bytes": int(cache.lengths.sum()) * len(cache.tap_indices) * cache.hidden * 2}))
    return 0


def register(sub) -> None:
    c = sub.add_parser("cache-features", help="run the frozen target once over a token store and cache its taps")
    c.add_argument("--target", default="default")
    c.add_argument("--data", required=True, help="token store written by `specjax regenerate`")
    c.add_argument("--out", required=True, help="cache directory (resumes a partial cache)")
    c.add_argument("--tap-indices", default=None, help="hidden-state indices to cache (default: the union of "
                   "the default DFlash and EAGLE-3 taps for this target)")
    c.add_argument("--num-taps", type=int, default=5, help="DFlash taps assumed by the default --tap-indices")
    c.add_argument("--max-len", type=int, default=512, help="tokens cached per sequence")
    c.add_argument("--batch-tokens", type=int, default=2048, help="tokens per target forward")
    c.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the target over this many devices, as serving does")
    c.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="split each forward's sequences over this many devices (the target replicated)")
    c.add_argument("--compile-cache", default=DEFAULT_CACHE)
    add_quant_kernel_arg(c)  # the taps of the target as inference runs it (a drafter reads those)
    c.set_defaults(func=cmd_cache_features)
