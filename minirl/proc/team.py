"""The OpenMP team of a run that trains and samples in one process: a thread per core while the cores
are free, fewer while other processes hold some.

The trainer and the in-process engine share one team of threads. At each of a step's thousands of
small parallel regions a thread that finishes first waits at a barrier, spinning `GOMP_SPINCOUNT`
rounds before it sleeps. Long spins keep a quiet machine's step fast (a sleeping peer costs a
wake-up at every region); beside a process that holds a core they make it many times slower, the
spinning thread taking the core its peer needs (docs/results/speed.md). libgomp reads the count
once, as it loads; the team's size can change at any time. So where minirl chose both (`MINIRL_THREADS
= auto`: the CLI set neither OMP_NUM_THREADS nor GOMP_SPINCOUNT because the user did not), a run
whose engine shares its process spins long (SPIN) and watches its cores between steps: while
other processes keep some busy the team shrinks to the cores left (one thread waits at no
barrier), and it grows back once they are free. Elsewhere (the user's own settings, an engine in a
process of its own, ranks of a torchrun job, the suite's runs) the team stays as it was set and the
CLI's short spin guards it.

Results computed by teams of different sizes can differ in their last bits (a reduction split
another way), so a run that shrank is not bit-for-bit the quiet run of its seed; the metrics rows
say each step's team (`timing/threads`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

AUTO = "MINIRL_THREADS"  # set to "auto" by the CLI where it chose the team and the spin (cli/main.py)
USER_THREADS = "threads"  # AUTO's value where the user set OMP_NUM_THREADS and the CLI chose the (short) spin
# long enough that a peer does not fall asleep between a step's small regions: libgomp's own default. A count
# is rounds of a pause loop whose length differs by CPU: 30,000 covered a step's gaps on the Xeon it was chosen
# on, but fell short of the engine's gaps on an AVX-512 EPYC (measured in docs/results/speed.md)
SPIN = "300000"
STAT = Path("/proc/stat")
WINDOW_S = 1.0  # how long the cores are watched before the team changes: a passing neighbour is ignored


def adapts(rec, env=os.environ) -> bool:
    """Whether a run of recipe `rec` watches its cores: only where minirl chose the threads and the spin,
    and the one team is all of the run's threads (its engine in its process: no `max_staleness`, no
    rollout GPUs; not a rank of a torchrun job)."""
    return env.get(AUTO) == "auto" and _one_team(rec, env)


def fixed_team_note(rec, env=os.environ) -> str | None:
    """A line for a run that would watch its cores and spin long but for the user's OMP_NUM_THREADS (set
    without GOMP_SPINCOUNT): it keeps the user's team with the CLI's short spin, which guards a busy
    machine and costs a quiet one (docs/runs.md). None elsewhere."""
    if env.get(AUTO) != USER_THREADS or not _one_team(rec, env):
        return None
    return (f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')} is set: the run keeps that many threads and waits at each "
            f"barrier with short spins (GOMP_SPINCOUNT={env.get('GOMP_SPINCOUNT')}), slower on a quiet machine; "
            "unset it to let minirl size its team to the free cores, or set GOMP_SPINCOUNT too (docs/runs.md)")


def _one_team(rec, env) -> bool:
    """The one team is all of the run's threads: its engine in its process (no `max_staleness`, no rollout
    GPUs), not a rank of a torchrun job."""
    shares_process = not rec.rollout.max_staleness and not rec.parallel.rollout_gpus
    return shares_process and int(env.get("WORLD_SIZE", "1")) == 1


def wanted(cores: int, others: float, most: int) -> int:
    """The team for `cores` when other processes kept `others` of them busy (in cores, over a window):
    the cores left, rounded, between one and `most` (the team minirl started with)."""
    return max(1, min(most, round(cores - others)))


def busy_ticks(cpus: set[int], stat: str) -> int:
    """The clock ticks CPUs `cpus` spent on anything but idling, by /proc/stat's per-CPU lines (user,
    nice, system, idle, iowait, irq, softirq, steal, ...): steal counts, a vCPU the host gave away
    being as lost to the team as one another process holds."""
    total = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]
            total += sum(ticks) - ticks[3] - ticks[4]
    return total


def tree_ticks(pid: int, proc: Path = Path("/proc")) -> int:
    """Clock ticks process `pid` and its live descendants spent (user and system, with the children
    each has waited for): a run's own work, its graders' sandboxes and hosted environments included,
    which its team waits for rather than competes with."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = (proc / str(p) / "stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime (stat's fields 14-17)
            for task in (proc / str(p) / "task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue  # it ended between two reads: what it spent is its parent's now (cutime)
    return total


class Team:
    """`start()` once the engine is built, then `after_step()` between steps: the team's size for the
    next one (unchanged unless the window says so). Inert (the size it found, never changed) where
    `watch` is False."""

    def __init__(self, *, watch: bool):
        import torch  # deferred: the CLI reads this module's settings before torch (and libgomp with it) loads

        self._torch = torch
        self.threads = self.most = torch.get_num_threads()
        # the process's CPUs as it starts: vLLM's engine later binds each team thread to one, which
        # narrows what the main thread's own mask says
        self._cpus = os.sched_getaffinity(0)
        self._hz = os.sysconf("SC_CLK_TCK")
        self._watch = watch and self.most > 1 and len(self._cpus) > 1 and STAT.is_file()
        self._grow = False  # the last window wanted a larger team too (growing needs two in a row)
        self._since: tuple[float, tuple[float, float]] | None = None  # the window's start: (wall, _cpu())

    def start(self) -> None:
        """The first window opens: once the engine is built (its start runs helper processes of its own,
        which a window would count as others')."""
        if self._watch:
            self._since = (self._wall(), self._cpu())

    @property
    def watched(self) -> bool:
        return self._watch

    def _wall(self) -> float:
        return time.monotonic()

    def _cpu(self) -> tuple[float, float]:
        """(busy seconds of the CPUs, CPU seconds of this process (every thread's, the engine's too) and
        its descendants): read once a window, not every step."""
        return busy_ticks(self._cpus, STAT.read_text()) / self._hz, tree_ticks(os.getpid()) / self._hz

    def after_step(self) -> int:
        if not self._watch:
            return self.threads
        t = self._wall()
        wall = t - self._since[0]
        if wall < WINDOW_S:
            return self.threads
        (busy0, own0), now = self._since[1], self._cpu()
        others = max(0.0, (now[0] - busy0) - (now[1] - own0)) / wall
        self._since = (t, now)
        want = wanted(len(self._cpus), others, self.most)
        # shrink at once (a neighbour makes every step several times slower); grow after two windows
        # agree (a neighbour that paused for a moment would have the team shrink again)
        if want < self.threads or (want > self.threads and self._grow):
            self.threads = want
            self._torch._C.set_num_threads(want)  # vLLM replaces torch.set_num_threads with a refusal once it binds
        self._grow = want > self.threads
        return self.threads
