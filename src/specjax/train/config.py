"""Training settings (`TrainConfig`): batch shape, objective weights, learning-rate schedule, optimizer, and the
intervals of the loop's periodic actions (log, checkpoint, simulated tau, engine evaluation)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    block_size: int = 16
    batch_size: int = 4  # sequences per step
    num_anchors: int = 32  # anchor blocks per sequence (paper: 512 on GPUs)
    max_len: int = 512  # longest training sequence (prompt + response), tokens
    steps: int = 2000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; None = paper values (7 for Q=16, 5 for Q=10, 4 for Q=8)
    dpace_alpha: float | None = None  # DFlash: D-PACE slot weights with this smoothing instead of the decay
    distill: float = 0.0  # DFlash: weight of the KL to the target's next-token distribution in each slot's loss
    seed: int = 0
    save_every: int = 200
    eval_every: int = 500
    log_every: int = 10
    schedule: str = "cosine"  # "cosine" (to 0 at `steps`), "constant" (warm-up, then flat: for open-ended runs) or
    # "cosine-time" (warm-up and cosine over the wall time of --max-hours, measured from the end of the first step:
    # equal-time A/Bs and machines of unknown speed finish their schedule whatever a step costs; `steps` caps it)
    optimizer: str = "adamw"  # "adamw" or "muon" (Newton-Schulz on matrices, AdamW on vectors)
    max_hours: float | None = None  # stop (and save) after this much wall time: equal-time A/Bs, long runs
    sim_every: int = 100  # simulated tau on the held-out store every this many steps (0 = never)
    grown_layers: int = 0  # DFlash: the last this many layers were appended to the init drafter (--grow-layers) ...
    grown_lr_scale: float = 1.0  # ... and train at this multiple of the learning rate (they start from zero output)
    pad_multiple: int = 64  # batch lengths padded to a multiple of this (max_len: one compiled step shape)
    keep_best: bool = False  # also keep the drafter of the best simulated tau so far (OUT/best-drafter, best.json)

    def __post_init__(self):
        if self.schedule not in ("cosine", "constant", "cosine-time"):
            raise ValueError(f"unknown schedule {self.schedule!r} (cosine, constant, cosine-time)")
        if self.schedule == "cosine-time" and not self.max_hours:
            raise ValueError("--schedule cosine-time runs over the wall time of --max-hours: give it")
        if self.pad_multiple < 1:
            raise ValueError(f"--pad-multiple must be >= 1, got {self.pad_multiple}")
        if self.keep_best and not self.sim_every:
            raise ValueError("--keep-best picks the drafter by simulated tau: give --sim-every > 0 (and --heldout)")

    @property
    def decay(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2.3))
