"""GPU memory of a step, phase by phase, for its metrics row (nothing on a CPU).

One peak for the whole step cannot tell the trainer's memory from the engine's: on the H200 a
0.76B MoE step peaked at 80.4 GiB "allocated", the engine's pool and the trainer's activations in
one figure (#72). The step's stopwatch ends each phase with a lap (stopwatch.py); each lap here
reads the most torch's allocator held during the phase, and what it holds at its end, and resets
the peak. The trainer's own peak is then the most held during the phases that train, less what
others held when they began (the engine: nothing asleep at level 2, its weights and KV cache awake):
what the plan's training phase predicts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GiB = 2**30
TRAINING = ("old_logp", "update")  # the phases the trainer computes in (run/loop.py's laps)


class PhasePeaks:
    def __init__(self, device: torch.device, *, resident: Callable[[], int]):
        """resident(): the bytes the trainer itself holds on the device now (Trainer.device_bytes)."""
        self.on = device.type == "cuda"
        self.device, self.resident = device, resident
        self._peaks: dict[str, int] = {}
        self._beside: int | None = None  # held by others when the trainer began this step's training
        self._others = 0  # held by others at the last lap

    def lap(self, phase: str) -> None:
        """The end of `phase` (Stopwatch's `on_lap`)."""
        if not self.on:
            return
        peak = torch.cuda.max_memory_allocated(self.device)
        self._peaks[phase] = max(self._peaks.get(phase, 0), peak)
        if phase in TRAINING and self._beside is None:
            self._beside = self._others  # as the phase began: the last lap's
        self._others = torch.cuda.memory_allocated(self.device) - self.resident()
        torch.cuda.reset_peak_memory_stats(self.device)

    def row(self) -> dict[str, float]:
        """This step's figures, and a fresh start for the next: `gpu/peak_alloc_gib` (the most held
        at once, anything of torch's), `gpu/train_peak_gib` (the trainer's own: its state and what
        its forwards and backwards hold), `gpu/beside_trainer_gib` (what others held as it began:
        the engine), `gpu/used_gib` (the device's use now, after the sync: the CUDA context and
        anything outside torch too)."""
        if not self.on:
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        out = {"gpu/peak_alloc_gib": round(max(self._peaks.values(), default=0) / GiB, 3),
               "gpu/used_gib": round((total - free) / GiB, 3)}
        trained = [self._peaks[p] for p in TRAINING if p in self._peaks]
        if trained and self._beside is not None:
            out["gpu/train_peak_gib"] = round((max(trained) - self._beside) / GiB, 3)
            out["gpu/beside_trainer_gib"] = round(self._beside / GiB, 3)
        self._peaks, self._beside = {}, None
        return out
