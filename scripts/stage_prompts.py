"""Pack the training prompt sources for a machine without ../shared or the ShareGPT package (the device tool):

    python scripts/stage_prompts.py OUT_DIR [--data-dir ../shared/data]

OUT_DIR gets gsm8k_train.jsonl, codealpaca_train.jsonl, mbpp.jsonl (copies) and sharegpt.json: the first user turn
of every ShareGPT conversation `specjax regenerate` would use, and the second where `sharegpt_turn2` uses it (the
package's 120 MB JSON does not travel; this is a few MB; the first answer before a second turn is the store's).
There, `specjax regenerate --data-dir OUT_DIR --sharegpt-file OUT_DIR/sharegpt.json` sees the same prompts, with the
same ids, as here.
"""

import argparse
import json
import os
import shutil

from specjax.datasets import default_data_dir, load_train_prompts

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    src = args.data_dir or default_data_dir()
    os.makedirs(args.out, exist_ok=True)
    for name in ("gsm8k_train.jsonl", "codealpaca_train.jsonl", "mbpp.jsonl"):
        shutil.copyfile(os.path.join(src, name), os.path.join(args.out, name))
    conversations = {p.id.split("/", 1)[1]: [{"from": "human", "value": p.turns[0]}]
                     for p in load_train_prompts(["sharegpt"], src)}
    for p in load_train_prompts(["sharegpt_turn2"], src):  # the second turn, after an empty stand-in answer
        conversations[p.after.split("/", 1)[1]] += [{"from": "gpt", "value": ""},
                                                    {"from": "human", "value": p.turns[1]}]
    records = [{"id": rid, "conversations": conv} for rid, conv in conversations.items()]
    with open(os.path.join(args.out, "sharegpt.json"), "w", encoding="utf-8") as fh:
        json.dump(records, fh)
    print(f"{len(records)} ShareGPT prompts -> {args.out}/sharegpt.json")
