"""How far int8 activations move a GGUF target from its float32 products: teacher-forced on the float32 model's own
greedy answers to held-out prompts, the same sequences through both, per answer position: argmax agreement, mean
|logit difference| and KL(float32 || int8); and where the two greedy answers first part.

    python scripts/int8_quality.py [--model PATH] [--datasets gsm8k,mt_bench] [--num-prompts 5] [--max-new-tokens 128]
        [--out FILE]

Both runs use specjax's CPU kernels (kernels/quant_matmul.cc), float32 or int8 activations (`--kernel-activations`).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--datasets", default="gsm8k,math500,humaneval,mbpp,mt_bench")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from specjax.config import EngineConfig
    from specjax.datasets import load_eval
    from specjax.llm import LLM
    from specjax.model.loader import load_model
    from specjax.sampling import SamplingParams
    from specjax.spec.reference import full_forward

    models = {a: load_model(args.model, quant_kernels=True, activations=a) for a in ("float32", "int8")}
    assert [m.kernel_activations for m in models.values()] == ["float32", "int8"]
    cfg = EngineConfig(max_model_len=1024, max_num_seqs=1)
    llms = {a: LLM(method="ar", target=m, engine_config=cfg) for a, m in models.items()}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    report = {"model": models["int8"].source, "datasets": {}}
    for name in args.datasets.split(","):
        agree, dlogit, kl, parted = [], [], [], []
        for prompt in load_eval(name, args.data_dir)[:args.num_prompts]:
            ids = llms["float32"].encode(prompt.turns[0])  # the first turn
            out = {a: llm.generate([ids], params)[0].token_ids for a, llm in llms.items()}
            parted.append(next((i for i, (x, y) in enumerate(zip(out["float32"], out["int8"])) if x != y),
                               min(len(out["float32"]), len(out["int8"]))))
            seq = ids + out["float32"]
            logits = {a: full_forward(m.weights, m.config, seq)[0][len(ids) - 1:-1].astype(np.float64)
                      for a, m in models.items()}
            f, q = logits["float32"], logits["int8"]
            agree.append(float(np.mean(f.argmax(-1) == q.argmax(-1))))
            dlogit.append(float(np.mean(np.abs(f - q))))
            lp = f - np.logaddexp.reduce(f, -1, keepdims=True)
            lq = q - np.logaddexp.reduce(q, -1, keepdims=True)
            kl.append(float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1))))
        row = {"argmax_agreement": float(np.mean(agree)), "mean_abs_dlogit": float(np.mean(dlogit)),
               "kl": float(np.mean(kl)), "first_parting_median": float(np.median(parted)), "partings": parted}
        report["datasets"][name] = row
        print(f"{name:>10}: argmax agreement {row['argmax_agreement']:.4f}  mean |dlogit| {row['mean_abs_dlogit']:.4f}"
              f"  KL {row['kl']:.2e}  greedy answers part at {parted}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
