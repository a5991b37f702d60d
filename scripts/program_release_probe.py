"""What the framework's caches keep of the step programs a server builds: the 13 shapes session 38's 10-minute soak
compiled (7 prefill, 6 decode), built on the background thread of a fresh engine of the embedded default, with the
caches released when the queue runs empty (the default) and without; resident memory after, each arm in its own
process, ARMS rounds alternating.  JSON on stdout (docs/results/startup/program-release-probe.json).

    python scripts/program_release_probe.py > docs/results/startup/program-release-probe.json
"""

import json
import statistics
import subprocess
import sys

ARMS = 3
SOAK_SHAPES = [("prefill", 1, 256, 1), ("decode", 1, 0, 0), ("prefill", 4, 64, 1), ("decode", 4, 0, 0),
               ("prefill", 4, 128, 1), ("decode", 8, 0, 0), ("decode", 16, 0, 0), ("decode", 16, 1, 0),
               ("decode", 16, 3, 0), ("prefill", 1, 64, 1), ("prefill", 1, 128, 1), ("prefill", 2, 64, 1),
               ("prefill", 2, 128, 1)]  # (kind, batch, n, pages); decode pages 0 = the widest, as on the kernels


def child(release: bool) -> None:
    import time

    from specjax.engine.engine import GREEDY
    from specjax.engine.programs import StepShape
    from specjax.hostmem import release_freed_memory, resident_bytes
    from specjax.llm import LLM

    engine = LLM().engine
    if not release:
        engine.programs._release = None
    widest = engine._full_pages
    shapes = [StepShape(kind, b, n, pages or widest, GREEDY) for kind, b, n, pages in SOAK_SHAPES]
    release_freed_memory()
    before = resident_bytes()
    t0 = time.perf_counter()
    engine.programs.prefetch(shapes)
    engine.programs.wait_idle()  # built, and (by default) the caches released
    seconds = time.perf_counter() - t0
    release_freed_memory()
    print(json.dumps({"programs": len(engine.programs.ready), "build_s": round(seconds, 1),
                      "rss_growth_mb": round((resident_bytes() - before) / 1e6, 1)}))


def main() -> None:
    runs = {"release": [], "no_release": []}
    for _ in range(ARMS):
        for arm in runs:
            out = subprocess.run([sys.executable, __file__, "--child", arm], capture_output=True, text=True,
                                 check=True).stdout
            runs[arm].append(json.loads(out.strip().splitlines()[-1]))
            print(arm, runs[arm][-1], file=sys.stderr, flush=True)
    res = {"shapes": len(SOAK_SHAPES), "runs": runs,
           "median_rss_growth_mb": {a: statistics.median(r["rss_growth_mb"] for r in v) for a, v in runs.items()}}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv[-1] == "release")
    else:
        main()
