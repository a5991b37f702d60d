#!/usr/bin/env bash
# Stage the default GGUF target for a device machine whose calls carry at most 64 MiB (repo root, venv active):
#   scripts/device_stage.sh [GGUF]
# Writes .dev/a/gguf.part00 (the first 64,000,000 bytes) and .dev/b/gguf.part01 (the rest) plus the gguf wheel the
# device image lacks and prompts.tgz (the training prompts, scripts/stage_prompts.py: for scripts/device_regen.sh)
# into .dev/ (git-ignored), and prints the two calls that join them there. Before the calls,
# make the tracked tree small (data/, docs/ and the drafter assets untracked in the index only, and ignored):
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
python scripts/stage_prompts.py .dev/prompts > /dev/null
tar czf .dev/b/prompts.tgz -C .dev prompts && rm -rf .dev/prompts
sum=$(sha256sum "$gguf" | cut -d' ' -f1)
cat <<EOF
staged $(du -sh .dev/a | cut -f1) in .dev/a and $(du -sh .dev/b | cut -f1) in .dev/b; sha256 $sum
call 1 (carry [".dev/a"]):          mkdir -p /root/gg && cp .dev/a/gguf.part00 /root/gg/
call 2 (carry [".dev/b", "data"]), within the machine's 30 s warm window:
  cat /root/gg/gguf.part00 .dev/b/gguf.part01 > /root/gg/t.gguf && echo "$sum  /root/gg/t.gguf" | sha256sum -c &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/b/*.whl && export PYTHONPATH=/tmp/site &&
  scripts/device_train.sh \$OUT /root/gg/t.gguf MINUTES ARM...
  (or, to grow the store first: tar xzf .dev/b/prompts.tgz -C /root/gg && scripts/device_regen.sh \$OUT /root/gg/t.gguf
   /root/gg/prompts MINUTES; the next call then trains on it: DATA=... scripts/device_train.sh ...)
EOF
