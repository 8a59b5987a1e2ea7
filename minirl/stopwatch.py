"""Seconds per phase of a run, summed over its steps (the `timing/<phase>_s` metrics)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Stopwatch:
    """Laps booked to named phases of one running total (`totals`, which a checkpoint keeps).

    >>> clock = Stopwatch({})
    >>> clock.lap("rollout"); clock.lap("update"); sorted(clock.totals)
    ['rollout', 'update']
    """

    def __init__(self, totals: dict[str, float], *, on_lap: Callable[[str], None] | None = None):
        """on_lap(phase): called as each lap ends a phase (run/gpumem.py reads the GPU's memory there)."""
        self.totals, self.on_lap = totals, on_lap
        self._t = time.perf_counter()

    def start(self) -> None:
        """Start a lap here (what happened since the last lap is booked nowhere)."""
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Book the time since the last lap (or `start`) to `phase`."""
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + (now - self._t)
        if self.on_lap is not None:
            self.on_lap(phase)
        self._t = time.perf_counter()  # what on_lap costs is booked nowhere
