"""What a loaded step program's heap is made of: runs itself under heaptrack (loading one decode step of the embedded
default, batch 4 and the largest K, LOADS times from its serialized bytes), then sums the memory still held at exit
under XLA's executable loader by the function each allocation came from.  Needs `heaptrack` / `heaptrack_print`
(Debian: apt install heaptrack).  JSON on stdout (docs/results/startup/program-heap-profile.json).

    python scripts/program_heap_profile.py > docs/results/startup/program-heap-profile.json
"""

import collections
import json
import os
import subprocess
import sys
import tempfile

LOADS = 4
LOADER = "CpuAotCompilationResult::LoadExecutable"  # XLA:CPU's deserialization of a compiled program


def child() -> None:
    """Build the program (persistent cache as configured), then load its bytes LOADS times and exit without freeing
    anything, so that heaptrack reports every loaded copy as still held."""
    from jax.experimental import serialize_executable
    from program_memory_probe import decode_program  # this script's folder is on sys.path

    (blob, in_tree, out_tree), info = decode_program()
    info["loads"] = LOADS
    print(json.dumps(info), flush=True)
    keep = [serialize_executable.deserialize_and_load(blob, in_tree, out_tree) for _ in range(LOADS)]
    assert len(keep) == LOADS
    os._exit(0)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace")
        out = subprocess.run(["heaptrack", "-o", trace, sys.executable, __file__, "--child"], capture_output=True,
                             text=True, check=True)
        info = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
        stacks = os.path.join(tmp, "leaked.stacks")
        data = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith("trace"))
        subprocess.run(["heaptrack_print", "-f", data, "--flamegraph-cost-type", "leaked", "-F", stacks],
                       capture_output=True, check=True)
        by_part: collections.Counter = collections.Counter()
        with open(stacks, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                stack, nbytes = line.rsplit(" ", 1)
                frames = stack.split(";")
                at = [i for i, f in enumerate(frames) if LOADER in f]
                if at:
                    part = frames[at[-1] + 1] if at[-1] + 1 < len(frames) else "(the loader itself)"
                    by_part[part.split("(")[0]] += int(nbytes)
    total = sum(by_part.values())
    info["held_per_load_mb"] = round(total / LOADS / 1e6, 2)
    info["held_per_load_mb_by_part"] = {k: round(v / LOADS / 1e6, 2) for k, v in by_part.most_common()
                                        if v / LOADS >= 1e4}
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
