"""The run's own part of a checkpoint's record (the trainer, the rollouts and the guard keep theirs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunState:
    """The run's own part of a checkpoint's record: its step, the held-out score it started from,
    its stopwatch and its learning rate (lowered at each rollback). The trainer's weights, the
    rollouts' sampler and the guard record their own parts (`record` / `restore` on each)."""

    run_dir: Path
    lr: float
    step: int = 0
    heldout_start: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def record(self) -> dict:
        return {"step": self.step, "heldout_start": self.heldout_start, "timing": self.timing, "lr": self.lr}

    def restore(self, record: dict) -> None:
        self.step = record["step"]
        self.heldout_start = record.get("heldout_start", {})
        self.timing = record.get("timing", {})
        self.lr = record.get("lr", self.lr)
