"""A step's GPU memory, phase by phase (run/gpumem.py), at the seam that cannot exist here: torch's
CUDA allocator counters, replayed as a colocated step uses them (#72: one "peak" held the
engine's pool and the trainer's activations together)."""

from __future__ import annotations

import torch

from minirl.run import gpumem
from minirl.stopwatch import Stopwatch

GiB = 2**30


def test_the_trainers_peak_is_told_from_the_engines_pool(monkeypatch):
    # (phase, most held during it, held at its end) of one step: the engine awake with 20 GiB while it
    # samples, asleep (2 GiB left) while the trainer (10 GiB of state) trains up to 50 GiB
    phases = [("rollout", 31, 30), ("grade", 30, 12), ("old_logp", 20, 12), ("update", 62, 12), ("sync", 32, 30),
              ("parity", 31, 30)]
    now = {"peak": 0, "held": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: now["peak"] * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: now["held"] * GiB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GiB, 141 * GiB))
    meter = gpumem.PhasePeaks(torch.device("cuda"), resident=lambda: 10 * GiB)
    clock = Stopwatch({}, on_lap=meter.lap)
    for phase, peak, held in phases:
        now.update(peak=peak, held=held)
        clock.lap(phase)
    row = meter.row()
    assert row == {"gpu/peak_alloc_gib": 62.0, "gpu/train_peak_gib": 60.0, "gpu/beside_trainer_gib": 2.0,
                   "gpu/used_gib": 41.0}
    assert meter.row()["gpu/peak_alloc_gib"] == 0.0  # each row is its own step's
    assert gpumem.PhasePeaks(torch.device("cpu"), resident=lambda: 0).row() == {}


def test_the_trainer_counts_what_it_holds_on_its_device():
    from minirl.models.shapes import TINY
    from minirl.train.batch import build_batch
    from minirl.train.sft import sft_loss
    from minirl.train.trainer import Trainer

    tr = Trainer(TINY, lr=1e-3, seed=0)
    weights = sum(p.numel() * 4 for p in tr.model.parameters())
    assert weights <= tr.device_bytes() <= weights + sum(b.numel() * b.element_size() for b in tr.model.buffers())
    tr.forward_backward(build_batch([[4, 5]] * 2, [[6, 2]] * 2, None, None, pad_id=0), sft_loss)
    tr.optim_step()  # Adam's two moments, the gradients gone
    assert tr.device_bytes() >= 3 * weights
