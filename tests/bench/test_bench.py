"""specjax bench / analyze: end-to-end on a tiny checkpoint, and the acceptance theory against known values."""

import json

import numpy as np
import pytest

from specjax.bench.theory import analyze, expected_tau_geometric, fit_record
from specjax.cli import main


@pytest.mark.parametrize("alpha,k,expected", [(0.70, 3, 2.53), (0.80, 7, 4.16), (0.86, 15, 6.50), (0.90, 9, 6.51)])
def test_expected_tau_matches_the_spec_table(alpha, k, expected):
    assert expected_tau_geometric(alpha, k) == pytest.approx(expected, abs=0.01)


def test_geometric_fit_recovers_alpha_from_synthetic_traces():
    rng = np.random.default_rng(0)
    alpha, k = 0.75, 7
    traces = []
    for _ in range(200):
        steps = []
        for _ in range(20):
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            steps.append(a + 1)
        traces.append(steps)
    fit = fit_record({"num_draft_tokens": k, "acceptance_lengths": traces})
    assert fit["alpha"] == pytest.approx(alpha, abs=0.02)
    assert fit["p"][0] == pytest.approx(alpha, abs=0.02) and fit["p"][2] == pytest.approx(alpha ** 3, abs=0.02)
    kflat = {"results": [{"q": q, "median_s": 0.01 * (1 + 0.1 * (q - 1))} for q in (1, 2, 4, 8, 16)]}
    [row] = analyze({"records": [{"dataset": "d", "method": "ngram", "num_draft_tokens": k,
                                  "acceptance_lengths": traces}]}, kflat, max_k=15)
    assert 1 <= row["recommended_k"] <= 15 and row["recommended_speedup"] > 1
    # a DFlash step pays its drafter, except on prompt lookup's steps (which skip it): half of them, half the cost
    kflat["draft"] = [{"block_size": b, "median_s": 0.004} for b in (2, 16)]
    rec = {"dataset": "d", "method": "dflash", "num_draft_tokens": k, "acceptance_lengths": traces}
    [plain, half] = analyze({"records": [rec, {**rec, "method": "dflash+lookup", "lookup_share": 0.5}]}, kflat, 15)
    tau, t1 = plain["tau_empirical"][2], 0.01
    assert plain["predicted_speedup"][2] == pytest.approx(tau * t1 / (0.013 + 0.004))
    assert half["predicted_speedup"][2] == pytest.approx(tau * t1 / (0.013 + 0.002))


def test_bench_and_theory_cli_on_a_tiny_model(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--model", tiny_dirs["qwen3"], "--methods", "ar,ngram@2,dflash,dflash@2",
                 "--drafter", "random:1", "--block-size", "4", "--datasets", "gsm8k,mt_bench", "--num-prompts", "1",
                 "--max-new-tokens", "8", "--max-model-len", "1024", "--out-dir", str(out), "--compile-cache", ""]) == 0
    stdout = capsys.readouterr().out
    assert "| gsm8k | dflash |" in stdout and "| mt_bench | ngram@2 |" in stdout
    record = json.loads((out / "bench.json").read_text())
    recs = {(r["dataset"], r["method"]): r for r in record["records"]}
    assert recs[("mt_bench", "ar")]["num_requests"] == 2  # both turns
    assert all(r["matches_ar"] for r in record["records"])  # greedy: every method reproduces plain decoding
    assert recs[("gsm8k", "ar")]["speedup_vs_ar"] == pytest.approx(1.0)
    assert recs[("gsm8k", "ngram@2")]["num_draft_tokens"] == 2 and recs[("gsm8k", "dflash")]["block_size"] == 4
    # dflash@K drafts from --block-size when one is given (else a block of K + 1)
    assert recs[("gsm8k", "dflash@2")]["num_draft_tokens"] == 2 and recs[("gsm8k", "dflash@2")]["block_size"] == 4
    assert (out / "bench_speedup.png").exists() and (out / "bench_per_position.png").exists()
    kflat = tmp_path / "kflat"
    assert main(["analyze", "kflat", "--model", tiny_dirs["qwen3"], "--q", "1,2,4,8", "--context", "32",
                 "--repeats", "2", "--out-dir", str(kflat), "--compile-cache", ""]) == 0
    assert main(["analyze", "theory", "--from", str(out / "bench.json"), "--kflat", str(kflat / "kflat.json"),
                 "--out-dir", str(tmp_path / "theory")]) == 0
    assert "recommended K" in capsys.readouterr().out
    assert (tmp_path / "theory" / "theory.png").exists()


def test_bench_serve_cli_on_a_tiny_model(tiny_dirs, tmp_path):
    """Runs in a subprocess: the command starts uvicorn servers and engine threads of its own."""
    import subprocess
    import sys

    out = tmp_path / "serve"
    cmd = [sys.executable, "-m", "specjax.cli", "bench-serve", "--model", tiny_dirs["qwen3"], "--drafter", "random:1",
           "--block-size", "4", "--methods", "ar,dflash:no-cache", "--concurrency", "1,4", "--requests-per-level", "4",
           "--max-tokens", "8", "--num-prompts", "2", "--max-model-len", "1024", "--page-size", "128",
           "--max-num-seqs", "4", "--system-prompt-tokens", "64",
           "--rounds", "2", "--out-dir", str(out), "--compile-cache", "", "--warmup", "none"]
    # --warmup none: the shapes these few requests use compile on first use, not every bucket of both servers at
    # start-up (the slowest test of the suite, 212 s; warmup_all is tests/serve's fixture; no timing is asserted)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "bench_serve.json").read_text())
    rows = {(r["method"], r["concurrency"]): r for r in record["rows"]}
    d = "dflash:no-cache"  # DFlash without prefix caching, beside plain decoding with it
    assert set(rows) == {("ar", 1), ("ar", 4), (d, 1), (d, 4)}
    assert all(r["rounds"] == 2 and r["requests"] == 8 and r["output_tokens"] == 64 for r in rows.values())
    # both servers live at once (each one runs only while it is measured); per level the order alternates
    order = [(r["method"], r["concurrency"], r["round"]) for r in record["rounds"]]
    assert order == [("ar", 1, 0), (d, 1, 0), (d, 1, 1), ("ar", 1, 1),
                     ("ar", 4, 0), (d, 4, 0), (d, 4, 1), ("ar", 4, 1)]
    assert rows[("ar", 4)]["speedup_vs_ar"] == pytest.approx(1.0)
    tput = {(r["method"], r["round"]): r["throughput_tok_s"] for r in record["rounds"] if r["concurrency"] == 4}
    assert rows[(d, 4)]["paired_speedups"] == pytest.approx([tput[(d, i)] / tput[("ar", i)] for i in (0, 1)])
    assert min(rows[(d, 4)]["paired_speedups"]) <= rows[(d, 4)]["speedup_vs_ar"] <= max(rows[(d, 4)]["paired_speedups"])
    # the shared system prompt (~380 byte tokens: 2 full pages of 128) comes from the cache where it is on
    assert rows[("ar", 4)]["prefix_cache_hit_rate"] > 0.4 and rows[(d, 4)]["prefix_cache_hit_rate"] is None
    assert record["config"]["system_prompt_tokens"] == 64
    assert (out / "bench_serve.png").exists()
    assert f"| {d} | 4 |" in proc.stdout


def test_only_the_measured_server_runs():
    """bench-serve's servers share the machine: the ones not measured are stopped (SIGSTOP), not merely idle."""
    import subprocess
    import time

    from specjax.cli.serve import take_turn

    class Proc:  # the part of multiprocessing.Process that take_turn uses
        def __init__(self):
            self.popen = subprocess.Popen(["sleep", "60"])
            self.pid = self.popen.pid

        def is_alive(self):
            return self.popen.poll() is None

    def state(p) -> str:  # /proc/PID/stat's third field: T = stopped
        for _ in range(100):
            s = open(f"/proc/{p.pid}/stat").read().split()[2]
            if s in "TRS":
                return s
            time.sleep(0.01)
        return s

    servers = {m: (Proc(), None, None, None) for m in ("ar", "dflash", "ngram")}
    try:
        take_turn(servers, "dflash")
        time.sleep(0.1)
        assert {m: state(p) for m, (p, *_) in servers.items()} == {"ar": "T", "dflash": "S", "ngram": "T"}
        take_turn(servers, "ar")
        time.sleep(0.1)
        assert {m: state(p) for m, (p, *_) in servers.items()} == {"ar": "S", "dflash": "T", "ngram": "T"}
        take_turn(servers, None)  # what stop_servers does first: a stopped server cannot read "stop"
        time.sleep(0.1)
        assert {state(p) for p, *_ in servers.values()} == {"S"}
    finally:
        for p, *_ in servers.values():
            p.popen.kill()
            p.popen.wait()


def test_bench_serve_names_the_server_that_cannot_start(tiny_dirs, tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "specjax.cli", "bench-serve", "--model", tiny_dirs["qwen3"], "--drafter",
           str(tmp_path / "missing"), "--methods", "ar,dflash", "--concurrency", "1", "--max-model-len", "256",
           "--warmup", "none", "--compile-cache", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "the dflash server could not start" in proc.stderr and str(tmp_path / "missing") in proc.stderr


def test_request_lengths_vary_the_same_way_for_every_method():
    from specjax.bench.serving import request_max_tokens

    assert [request_max_tokens(i, 64, 0.0) for i in range(5)] == [64] * 5
    lengths = [request_max_tokens(i, 64, 0.5) for i in range(400)]
    assert lengths == [request_max_tokens(i, 64, 0.5) for i in range(400)]  # a function of the request index only
    assert min(lengths) >= 32 and max(lengths) <= 96 and len(set(lengths)) > 40
    assert abs(np.mean(lengths) - 64) < 3


def test_bench_serve_rejects_a_bad_length_spread(capsys):
    assert main(["bench-serve", "--max-tokens-spread", "1.5"]) != 0
    assert "--max-tokens-spread must be in [0, 1)" in capsys.readouterr().err
