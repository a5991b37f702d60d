#!/usr/bin/env bash
# Stage what scripts/device_train.sh needs on a lent accelerator machine whose calls carry at most 64 MiB and whose
# image has jax but neither specjax, its `gguf` dependency, ../shared nor the ShareGPT package. Run it here, from
# the repository root with the venv active, before a device run:
#   scripts/device_stage.sh [GGUF]        # default: the embedded SmolLM2-135M-Instruct GGUF
# It writes into .dev/ (git-ignored):
#   .dev/a/gguf.part00    the target's first 64,000,000 bytes
#   .dev/b/gguf.part01    the rest of it, the gguf wheel the image lacks, and prompts.tgz: the training prompt
#                         sources (gsm8k, codealpaca, mbpp copies and a few-MB sharegpt.json holding the user turns
#                         `specjax regenerate` would use, with the same ids as here) for the `regen` step
# and prints the two device calls that join the target there and start scripts/device_train.sh.
# Before those calls make the tracked tree small (data/, docs/ and the drafter assets untracked in the index only):
#   git rm -r --cached -q docs data src/specjax/assets
#   printf '/docs/\n/data/\n/src/specjax/assets/\n' >> .git/info/exclude
# and after them restore it: `git reset -q` and drop those three lines from .git/info/exclude.
set -eu
gguf=${1:-$(python -c "from specjax.model.loader import default_model_path; print(default_model_path())")}
grep -qx '/.dev/' .git/info/exclude || echo '/.dev/' >> .git/info/exclude
rm -rf .dev && mkdir -p .dev/a .dev/b
split -b 64000000 -d "$gguf" .dev/gguf.part
mv .dev/gguf.part00 .dev/a/ && mv .dev/gguf.part01 .dev/b/
version=$(python -c 'import importlib.metadata as m; print(m.version("gguf"))')
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d .dev/b "gguf==$version"
# The training prompt sources, packed so that `specjax regenerate --data-dir DIR --sharegpt-file DIR/sharegpt.json`
# sees there the same prompts, with the same ids, as here (second turns follow an empty stand-in answer: the real
# first answer is the store's).
python - .dev/prompts <<'EOF'
import json, os, shutil, sys

from specjax.datasets import default_data_dir, load_train_prompts

out, src = sys.argv[1], default_data_dir()
os.makedirs(out, exist_ok=True)
for name in ("gsm8k_train.jsonl", "codealpaca_train.jsonl", "mbpp.jsonl"):
    shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
conversations = {p.id.split("/", 1)[1]: [{"from": "human", "value": p.turns[0]}]
                 for p in load_train_prompts(["sharegpt"], src)}
for p in load_train_prompts(["sharegpt_turn2"], src):
    conversations[p.after.split("/", 1)[1]] += [{"from": "gpt", "value": ""}, {"from": "human", "value": p.turns[1]}]
with open(os.path.join(out, "sharegpt.json"), "w", encoding="utf-8") as fh:
    json.dump([{"id": rid, "conversations": conv} for rid, conv in conversations.items()], fh)
EOF
tar czf .dev/b/prompts.tgz -C .dev prompts && rm -rf .dev/prompts
sum=$(sha256sum "$gguf" | cut -d' ' -f1)
cat <<EOF
staged $(du -sh .dev/a | cut -f1) in .dev/a and $(du -sh .dev/b | cut -f1) in .dev/b; sha256 $sum
call 1 (carry [".dev/a"]):          mkdir -p /root/gg && cp .dev/a/gguf.part00 /root/gg/
call 2 (carry [".dev/b", "data"]), while the machine is still warm:
  cat /root/gg/gguf.part00 .dev/b/gguf.part01 > /root/gg/t.gguf && echo "$sum  /root/gg/t.gguf" | sha256sum -c &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/b/*.whl && export PYTHONPATH=/tmp/site &&
  scripts/device_train.sh \$OUT /root/gg/t.gguf MINUTES ARM...
  (or, to grow the store first: tar xzf .dev/b/prompts.tgz -C /root/gg &&
   PROMPTS=/root/gg/prompts scripts/device_train.sh \$OUT /root/gg/t.gguf MINUTES regen;
   a later call then trains on it: DATA=... scripts/device_train.sh ...)
EOF
