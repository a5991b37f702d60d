"""Hooks into a live engine for the probes in scripts/: the decode steps it runs, as it runs them."""

import contextlib


@contextlib.contextmanager
def decode_calls(engine):
    """Inside: every decode step `engine` runs is appended to the yielded list as (shape, program, args), where
    program is the engine's (step, commit) pair and args the step's inputs after the engine's own arrays (so
    `step(engine.tweights, engine.kv, engine.pweights, engine.pstate, *args)` runs it again).  The engine's `_run`
    is restored on exit."""
    calls, run = [], engine._run

    def capture(shape, program, *args):
        if shape.kind == "decode":
            calls.append((shape, program, args))
        return run(shape, program, *args)

    engine._run = capture
    try:
        yield calls
    finally:
        engine._run = run
