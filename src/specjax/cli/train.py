"""The training subcommands, one module each: `specjax regenerate` (cli/regenerate.py), `specjax cache-features`
(cli/cache_features.py) and `specjax train-drafter` (cli/train_drafter.py)."""

from __future__ import annotations

from specjax.cli import cache_features, regenerate, train_drafter


def register(sub) -> None:
    for module in (regenerate, cache_features, train_drafter):
        module.register(sub)
