"""Building one step program: dummy inputs of a step shape, the jitted prefill / decode step and the commit of its
rows (engine/runner.py) AOT-compiled for that shape, through the on-disk program store when there is one.

`ProgramBuilder` is a mixin of LLMEngine (engine/engine.py); it reads the engine's tcfg, proposer, tweights,
lookup_min_n, context_vocab, program_store, _state_spec and _inputs_placement, and its `_sampling`
(engine/model_runner.py).  engine/programs.py calls `_build_program` (maybe on its background thread).
"""

from __future__ import annotations

import jax
import numpy as np

from specjax.engine import runner
from specjax.engine.programs import StepShape
from specjax.model.target import ForwardBatch


class ProgramBuilder:
    """LLMEngine's step-program building (a mixin: see the module docstring)."""

    def _step_args(self, shape: StepShape) -> tuple:
        """Dummy inputs of a step shape (slots all -1: running them writes nothing; beside prompt lookup the
        proposer drafts, as timing a warm-up run for the K controller's cost prior needs)."""
        b, n, pg = shape.batch, shape.n, shape.pages
        if shape.kind == "prefill":
            batch = ForwardBatch(np.zeros((b, n), np.int32), np.zeros((b, n), np.int32),
                                 np.full((b, n), -1, np.int32), np.zeros((b, pg), np.int32))
            return batch, np.zeros(b, np.int32), np.zeros((b, n), np.int32), self._sampling([], b)
        zeros = np.zeros(b, np.int32)
        return (runner.DecodeBatch(zeros, zeros, np.full((b, n + 1), -1, np.int32), np.zeros((b, pg), np.int32),
                                   zeros, np.full((b, n), -1 if self.lookup_min_n else 0, np.int32),
                                   np.full((b, self.context_vocab), -1, np.int32) if self.context_vocab else None),
                self._sampling([], b))

    def _build_program(self, shape: StepShape):
        """Compile one step shape and the commit of its rows -> (step, commit), both AOT-compiled executables
        (the persistent compile cache applies)."""
        state = self._state_spec
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._inputs_placement),
                            self._step_args(shape))
        if shape.kind == "prefill":
            static = dict(tcfg=self.tcfg, proposer=self.proposer, mode=shape.mode)
            step = self._compile(runner.prefill_step, (*state, *args), static)
            _, rows, prows, _ = step.out_info
            slots = pslots = args[0].slots
        else:
            static = dict(tcfg=self.tcfg, proposer=self.proposer, num_draft=shape.n, mode=shape.mode,
                          lookup=bool(self.lookup_min_n))
            step = self._compile(runner.decode_step, (*state, *args), static)
            rows, prows, pslots = step.out_info[3:6]
            slots = args[0].slots
        commit = self._compile(runner.commit, (state[1], state[3], slots, rows, pslots, prows),
                               dict(kernel=self.tweights.kv_write_kernel))
        return step, commit

    def _compile(self, fn, args, static: dict):
        """AOT-compile jitted `fn` for `args` (ShapeDtypeStructs), through the program store when there is one."""
        if self.program_store is None:
            return fn.lower(*args, **static).compile()
        return self.program_store.get(fn.__name__, sorted(static.items()), args,
                                      lambda: fn.lower(*args, **static).compile())
