"""lm-evaluation-harness against `specjax serve`, without the network: the generation task (chat completions) and the
loglikelihood task (completions with echo and logprobs) over the first GSM8K test questions, served by plain decoding
and by DFlash: the same answers, log-likelihoods and scores.  The harness runs in a process of its own, as a client
does (it forks workers, which a process running JAX's threads must not)."""

import contextlib
import json
import os
import subprocess
import sys

import pytest

from specjax.bench.evalharness import GENERATION_TASK, LOGLIKELIHOOD_TASK, write_tasks
from specjax.bench.serving import running
from specjax.config import EngineConfig
from specjax.datasets import default_data_dir
from specjax.llm import LLM
from specjax.serve.api import create_app
from specjax.serve.metrics import Metrics
from specjax.serve.service import EngineService
from tests.helpers import cpu_env, import_or_missing, missing

pytestmark = pytest.mark.slow


def client(urls: dict[str, str], task_dir: str) -> dict:
    """Both tasks against each server, in one harness process (its start-up is most of the client's time) ->
    {method: {task: evaluate's result}}."""
    code = ("import json, sys; from specjax.bench.evalharness import evaluate; urls = json.loads(sys.argv[1]); "
            "print(json.dumps({m: {t: evaluate(u, 'tiny', t, sys.argv[2], limit=2) for t in sys.argv[3:]} "
            "for m, u in urls.items()}))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(urls), task_dir, GENERATION_TASK,
                           LOGLIKELIHOOD_TASK], capture_output=True, text=True, timeout=600, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lm_eval_scores_equal_with_and_without_speculation(tiny_dirs, tmp_path):
    import_or_missing("lm_eval")
    data_dir = default_data_dir()
    if data_dir is None or not os.path.exists(os.path.join(data_dir, "gsm8k_test.jsonl")):
        missing("../shared/data/gsm8k_test.jsonl is not here")
    write_tasks(str(tmp_path), os.path.join(data_dir, "gsm8k_test.jsonl"), max_gen_toks=24)
    with contextlib.ExitStack() as stack:  # both servers live at once; the harness queries one after the other
        urls, engines = {}, []
        for method in ("ar", "dflash"):
            kw = dict(drafter="random:1", block_size=4) if method == "dflash" else {}
            llm = LLM(tiny_dirs["qwen3"], method=method, engine_config=EngineConfig(
                max_model_len=512, page_size=16, max_num_seqs=2, prefill_chunk=128, adaptive_k=False), **kw)
            service = EngineService(llm.engine, llm.target.tokenizer, Metrics(max(1, llm.engine.num_draft)))
            urls[method] = stack.enter_context(running(create_app(service, "tiny", default_max_tokens=16), service))
            engines.append(llm.engine)
        results = client(urls, str(tmp_path))
    assert all(engine.allocator.num_used == 0 for engine in engines)
    for task in (GENERATION_TASK, LOGLIKELIHOOD_TASK):
        ar, spec = results["ar"][task], results["dflash"][task]
        assert len(ar["samples"]) == 2
        assert spec["samples"] == ar["samples"] and spec["metrics"] == ar["metrics"], task
    assert set(results["ar"][GENERATION_TASK]["metrics"]) >= {"exact_match"}
    assert set(results["ar"][LOGLIKELIHOOD_TASK]["metrics"]) >= {"perplexity", "acc"}
    assert results["ar"][LOGLIKELIHOOD_TASK]["metrics"]["perplexity"] > 1
