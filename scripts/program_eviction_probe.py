"""Does freeing a compiled step program give its host memory back?  Builds decode programs of the embedded default
target, then drops them from the engine (RSS after), then clears jax's caches too (RSS after); JSON on stdout."""

import gc
import json
import time

import jax

from specjax.engine.engine import GREEDY
from specjax.engine.programs import StepShape
from specjax.hostmem import release_freed_memory, resident_bytes
from specjax.llm import LLM


def rss() -> int:
    gc.collect()
    release_freed_memory()
    return resident_bytes()


def main() -> None:
    engine = LLM().engine
    k = engine.k_options[-1]
    shapes = [StepShape("decode", b, k, pg, GREEDY) for b in engine.batch_buckets[:4] for pg in engine.page_buckets[:2]]
    res = {"programs": len(shapes), "rss_before": rss()}
    t0 = time.perf_counter()
    for s in shapes:
        engine.programs.build_now(s)
    res["build_s"] = time.perf_counter() - t0
    res["rss_built"] = rss()
    for s in shapes:
        del engine.programs.ready[s]
    res["rss_dropped"] = rss()
    jax.clear_caches()
    res["rss_dropped_and_cleared"] = rss()
    res["freed_by_dropping_mb"] = (res["rss_built"] - res["rss_dropped"]) / 1e6
    res["freed_with_clear_caches_mb"] = (res["rss_built"] - res["rss_dropped_and_cleared"]) / 1e6
    res["built_mb"] = (res["rss_built"] - res["rss_before"]) / 1e6
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
