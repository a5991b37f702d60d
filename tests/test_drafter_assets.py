"""The shipped drafters stay small and hold only what inference and their provenance need: each directory under
src/specjax/assets/drafters/ is at most 25 MB and holds exactly config.json, model.safetensors (weights only, no
optimizer state), train_config.json and train_log.jsonl (both readable, and naming runs by date and commit, not by
private code names).  Checkpoints and optimizer state never ship: every shipped file lands in the history for good."""

import json
import os
import re
import struct

import pytest

import specjax

ASSETS = os.path.join(os.path.dirname(specjax.__file__), "assets", "drafters")
DRAFTERS = sorted(d for d in os.listdir(ASSETS) if os.path.isdir(os.path.join(ASSETS, d)))
EXPECTED = {"config.json", "model.safetensors", "train_config.json", "train_log.jsonl"}
MAX_BYTES = 25 * 1000 * 1000
OPTIMIZER_NAMES = re.compile(r"(^|[._/])(opt_state|optimizer|adam|muon|mu|nu|momentum|exp_avg|exp_avg_sq|count)"
                             r"([._/]|$)", re.IGNORECASE)
CODE_NAMES = re.compile(r"session[ _-]?[0-9]|recipe[ _-]?[0-9]", re.IGNORECASE)


def test_there_are_shipped_drafters():
    assert len(DRAFTERS) >= 2, DRAFTERS  # the DFlash and the EAGLE-3 drafter of the default target


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_shipped_drafter_holds_only_its_four_files_within_25_mb(name):
    path = os.path.join(ASSETS, name)
    entries = set(os.listdir(path))
    assert entries == EXPECTED, f"{name}: unexpected {sorted(entries - EXPECTED)}, missing {sorted(EXPECTED - entries)}"
    assert all(os.path.isfile(os.path.join(path, f)) for f in entries)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in entries)
    assert size <= MAX_BYTES, f"{name} is {size / 1e6:.1f} MB (at most {MAX_BYTES / 1e6:.0f} MB)"


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_shipped_drafter_holds_weights_not_optimizer_state(name):
    with open(os.path.join(ASSETS, name, "model.safetensors"), "rb") as fh:
        header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    tensors = [k for k in header if k != "__metadata__"]
    assert tensors and not [k for k in tensors if OPTIMIZER_NAMES.search(k)]


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_shipped_drafters_provenance_reads_and_names_no_code_names(name):
    path = os.path.join(ASSETS, name)
    with open(os.path.join(path, "train_config.json"), encoding="utf-8") as fh:
        text = fh.read()
    config = json.loads(text)
    assert config["method"] in ("dflash", "eagle3") and isinstance(config["train"], dict)
    with open(os.path.join(path, "train_log.jsonl"), encoding="utf-8") as fh:
        log = fh.read()
    rows = [json.loads(line) for line in log.splitlines()]
    assert rows and all("step" in r for r in rows)
    assert not CODE_NAMES.search(text) and not CODE_NAMES.search(log)
