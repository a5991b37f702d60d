"""EleutherAI's lm-evaluation-harness (`lm-eval`) as a client of `specjax serve`, on two local-file tasks over a
GSM8K-format JSON-lines file (`question`, `answer` ending in "#### <number>"), no network needed:

* `specjax_gsm8k_chat` (generate_until, through /v1/chat/completions with the harness's chat template handling):
  the last number of the answer against the reference's, exact match;
* `specjax_gsm8k_loglikelihood` (loglikelihood, through /v1/completions with echo and logprobs, the request every
  multiple-choice and perplexity task sends): the log-likelihood of the reference's final number given the
  question, as perplexity, and whether it is the greedy continuation (acc).

The task files are written for the data file given (`write_tasks`); `evaluate` runs one task against a server's
URL with the harness's own `local-chat-completions` / `local-completions` models (the tokenizer through the
server's /tokenize endpoints: a GGUF model has no Hugging Face tokenizer directory to give the client).
"""

from __future__ import annotations

import json
import os
import time

GENERATION_TASK = "specjax_gsm8k_chat"
LOGLIKELIHOOD_TASK = "specjax_gsm8k_loglikelihood"

_COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""

_GENERATION = """task: specjax_gsm8k_chat
{common}output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0
filter_list:
  - name: last_number
    filter:
      - function: regex
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: [",", "\\\\$", "\\\\.$"]
"""

_LOGLIKELIHOOD = """task: specjax_gsm8k_loglikelihood
{common}output_type: loglikelihood
doc_to_text: "Question: {{{{question}}}}\\nAnswer: the final answer is"
doc_to_target: " {{{{answer.split('####')[-1].strip()}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(directory: str, data_file: str, max_gen_toks: int = 128) -> None:
    """Write both task files into `directory` (the harness's `include_path`) for `data_file`."""
    data = json.dumps(os.path.abspath(data_file))
    common = _COMMON.format(data=data)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{GENERATION_TASK}.yaml"), "w") as fh:
        fh.write(_GENERATION.format(common=common, max_gen_toks=max_gen_toks))
    with open(os.path.join(directory, f"{LOGLIKELIHOOD_TASK}.yaml"), "w") as fh:
        fh.write(_LOGLIKELIHOOD.format(common=common))


def evaluate(url: str, model_name: str, task: str, task_dir: str, limit: int | None = None) -> dict:
    """Run `task` (from `write_tasks`) against the server at `url` -> {"metrics": {name: value}, "samples":
    [per-document results], "wall_s"}."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    if task == GENERATION_TASK:
        model, endpoint, extra = "local-chat-completions", "/v1/chat/completions", "tokenizer_backend=None"
    elif task == LOGLIKELIHOOD_TASK:
        model, endpoint, extra = "local-completions", "/v1/completions", "tokenizer_backend=remote"
    else:
        raise ValueError(f"unknown task {task!r} (one of {GENERATION_TASK}, {LOGLIKELIHOOD_TASK})")
    import httpx

    # requests fit the server's context (a loglikelihood request also asks for one token)
    max_length = httpx.get(f"{url}/tokenizer_info", timeout=30).json()["model_max_length"] - 1
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model, model_args=f"model={model_name},base_url={url}{endpoint},num_concurrent=1,max_retries=1,"
                                f"max_length={max_length},{extra}",
        tasks=[task], limit=limit, log_samples=True,
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),  # our tasks only: 12 s less to index
        apply_chat_template=task == GENERATION_TASK, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
        fewshot_random_seed=0)
    wall = time.perf_counter() - t0
    metrics = {k.split(",")[0]: v for k, v in out["results"][task].items()
               if isinstance(v, (int, float)) and not k.startswith("alias") and "stderr" not in k}
    samples = [{"doc_id": s["doc_id"], "resps": s["filtered_resps"]} for s in out["samples"][task]]
    return {"metrics": metrics, "samples": samples, "wall_s": wall}
