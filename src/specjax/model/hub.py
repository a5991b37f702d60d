"""Hugging Face Hub names ("org/name", "org/name@revision") -> local snapshot directories, through the HF cache.

Local paths always win: a name is looked up on the hub only when no file or directory of that name exists.
Downloads fetch only what specjax reads (configs, safetensors, tokenizer files) into the standard HF cache
(huggingface_hub's default; `HF_HUB_CACHE` is also read at call time) and respect `HF_HUB_OFFLINE=1`; with no
network, a cached snapshot is used and a missing one is a CheckpointError that says what to download and where.
"""

from __future__ import annotations

import os
import re

from specjax.model.checkpoint import CheckpointError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$")
FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def is_hub_name(name: str) -> bool:
    """True for "org/name[@revision]" strings that are not local paths."""
    return bool(REPO_ID.match(name)) and not os.path.exists(name)


def resolve(name: str, what: str = "model") -> str:
    """A local path unchanged; a hub name -> its snapshot directory (downloaded unless cached or offline)."""
    if not is_hub_name(name):
        return name
    repo, _, revision = name.partition("@")
    from huggingface_hub import constants, snapshot_download

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # set after import too (tests, notebooks)
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(repo, revision=revision or None, cache_dir=cache, allow_patterns=FILES,
                                 local_files_only=offline)
    except Exception as e:  # not cached and offline, no network, unknown or gated repo: one clear message
        rev = f" --revision {revision}" if revision else ""
        why = "HF_HUB_OFFLINE=1 and it is not in the cache" if offline else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"{what} {name!r} is not a local path and could not be loaded from the Hugging Face Hub ({why}). "
            f"Download it where there is network (`hf download {repo}{rev}`) into the cache {cache} "
            "(or set HF_HUB_CACHE), or pass a local directory") from e
