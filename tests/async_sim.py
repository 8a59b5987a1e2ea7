"""A simulated cluster that drives the real staleness controller (minirl/rollout/controller.py) and
the real dispatch (minirl/rollout/remote.py `shares`) on a simulated clock: one trainer and E
rollout engines, in either of minirl's two modes.

Each engine decodes its running sequences in lockstep (continuous batching, at most `slots` at a
time: the KV cache's limit, in sequences; one decode step costs `step_floor_s + step_per_seq_s ×
running`, the shape of a memory-bound decoder); a sequence queued behind full slots starts when
one frees, after its prompt's prefill (`prefill_s`, the engine paused). A batch's prompt groups go
to the engines as `shares` sends them: each to the engine with the fewest sequences not finished.
The trainer takes step s's batch once all of its sequences have finished, trains it at
`train_tokens_per_s`, then syncs:
- `inflight=True` (`rollout.inflight_updates`): the sync pauses every engine for `sync_s` at once;
  requests in flight are kept, and every token carries the version of the decode step that
  sampled it; batches of several steps share the engines' slots;
- `inflight=False` (minirl's default at k ≥ 1): an engine takes a sync after the batches sent
  before it, and the broadcast waits for the last engine (remote.py), the trainer with it; a batch
  sent after the sync starts after it, so every batch is one version's.
Nothing is dropped.

Used by tests/test_controller.py (small, random response times) and tests/bench/async_cluster.py
(cluster scale). No wall clock is read anywhere: the same seed gives the same run.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from minirl.rollout.controller import Controller
from minirl.rollout.remote import shares


@dataclass
class Cluster:
    engines: int = 8
    slots: int = 256
    step_floor_s: float = 0.010
    step_per_seq_s: float = 0.000047
    train_tokens_per_s: float = 400_000.0
    sync_s: float = 0.61
    prompts: int = 64  # B
    group: int = 16  # G
    lengths: Callable[[random.Random], int] = lambda rng: 1 + int(rng.expovariate(1 / 500))
    inflight: bool = True  # rollout.inflight_updates (else a sync waits for the batches sent before it)
    prefill_s: float = 0.0  # an engine's pause to prefill one sequence's prompt as it starts


@dataclass
class _Seq:
    length: int
    ticket: object
    start_tau: float = 0.0


@dataclass
class _Engine:
    tau: float = 0.0  # decode steps done
    running: list = field(default_factory=list)  # heap of (finish tau, id, seq)
    queue: list = field(default_factory=list)  # waiting for a slot, in order
    taus: list = field(default_factory=lambda: [0.0])  # the tau at which each version began ...
    versions: list = field(default_factory=lambda: [0])  # ... and that version
    paused_until: float = 0.0
    busy_s: float = 0.0  # decoding anything
    slot_s: float = 0.0  # sequence-seconds decoded (∫ running dt)


@dataclass
class Result:
    k: int
    wall_s: float
    steps: int
    tokens: int
    trainer_idle_s: float
    engine_busy_frac: float  # of engine time decoding anything
    slot_use: float  # of the engines' slots, on average
    staleness: dict[int, int]  # updates behind → trained tokens
    generated_lengths: list[int]  # of every sequence admitted for steps 1..steps, in admission order
    trained_lengths: list[int]  # of every sequence trained, in training order
    max_in_flight: int  # batches admitted and not trained, at most

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(s * c for s, c in self.staleness.items()) / n if n else 0.0


def simulate(k: int, steps: int, cluster: Cluster, seed: int = 0) -> Result:
    rng = random.Random(seed)
    c = cluster
    control = Controller(k, step=0)
    engines = [_Engine() for _ in range(c.engines)]
    now = 0.0
    remaining: dict[int, int] = {}  # ticket step → sequences not finished
    members: dict[int, list[_Seq]] = {}
    tokens_by_version: dict[int, dict[int, int]] = {}
    generated: dict[int, list[int]] = {}
    trainer_busy_until, trainer_idle, trained, trained_lengths = 0.0, 0.0, 0, []
    staleness: dict[int, int] = {}
    total_tokens, max_in_flight, seq_id = 0, 0, 0
    training: object | None = None  # the ticket under training, until trainer_busy_until (then a sync)

    def step_time(e: _Engine) -> float:
        return c.step_floor_s + c.step_per_seq_s * len(e.running)

    def start_queued(e: _Engine) -> None:
        nonlocal seq_id
        while e.queue and len(e.running) < c.slots:
            s = e.queue.pop(0)
            s.start_tau = e.tau
            seq_id += 1
            heapq.heappush(e.running, (e.tau + s.length, seq_id, s))
            e.paused_until = max(now, e.paused_until) + c.prefill_s

    def admit() -> None:
        nonlocal max_in_flight
        while control.may_admit() and control.next_step <= steps:
            t = control.admit(position=None)
            seqs = [_Seq(c.lengths(rng), t) for _ in range(c.prompts * c.group)]
            members[t.step], remaining[t.step], tokens_by_version[t.step] = seqs, len(seqs), {}
            generated[t.step] = [s.length for s in seqs]
            counts = shares(c.prompts, c.group, [len(e.running) + len(e.queue) for e in engines])
            lo = 0
            for e, n in zip(engines, counts):  # each its contiguous part, as remote.py sends it
                e.queue.extend(seqs[lo:lo + n * c.group])
                lo += n * c.group
                start_queued(e)
            max_in_flight = max(max_in_flight, len(control))

    def finish_seq(e: _Engine, s: _Seq) -> None:
        t = s.ticket
        counts = tokens_by_version[t.step]
        end = s.start_tau + s.length
        i = max(0, bisect.bisect_right(e.taus, s.start_tau) - 1)  # the version its first token was sampled by
        while i < len(e.taus) and e.taus[i] < end:  # token j is sampled by the decode step starting at start + j
            b = e.taus[i + 1] if i + 1 < len(e.taus) else math.inf
            lo = max(0, math.ceil(e.taus[i] - s.start_tau - 1e-9))
            hi = min(s.length, math.ceil(b - s.start_tau - 1e-9)) if b < math.inf else s.length
            if hi > lo:
                counts[e.versions[i]] = counts.get(e.versions[i], 0) + hi - lo
            i += 1
        remaining[t.step] -= 1
        if remaining[t.step] == 0:
            control.finish(t, tokens=tokens_by_version[t.step])

    admit()
    while trained < steps:
        # the trainer: a finished update syncs; an idle trainer takes the next batch when it is done.
        # One call at a time, the sync waits until every engine has finished what was sent before it
        drained = c.inflight or not any(e.running or e.queue for e in engines)
        if training is not None and now >= trainer_busy_until - 1e-12 and drained:
            training = None
            for e in engines:  # every engine pauses for the broadcast, then samples with the new version
                e.paused_until = now + c.sync_s
            now += c.sync_s
            for e in engines:
                e.taus.append(e.tau)
                e.versions.append(trained)
            control.updated(trained)
            admit()
        head = control.head()
        if training is None and head is not None and head.done:
            t = control.take(head.step)
            trained = t.step
            seqs = members.pop(t.step)
            n = sum(s.length for s in seqs)
            total_tokens += n
            trained_lengths.extend(s.length for s in seqs)
            for lag, count in t.staleness().items():
                staleness[lag] = staleness.get(lag, 0) + count
            training, trainer_busy_until = t, now + n / c.train_tokens_per_s
            admit()
            continue
        # the next event: an engine's next finish, or the end of the update under way
        nxt = trainer_busy_until if training is not None and trainer_busy_until > now + 1e-12 else math.inf
        for e in engines:
            if e.running:
                nxt = min(nxt, max(now, e.paused_until) + (e.running[0][0] - e.tau) * step_time(e))
        if nxt == math.inf:
            raise RuntimeError("the simulated cluster stalled: nothing running and nothing to take")
        if training is None or now >= trainer_busy_until - 1e-12:  # waiting for a batch, or for the sync to be taken
            trainer_idle += nxt - now
        for e in engines:  # advance each engine's decode to `nxt`
            if e.running:
                run_from = max(now, e.paused_until)
                if nxt > run_from:
                    e.tau += (nxt - run_from) / step_time(e)
                    e.busy_s += nxt - run_from
                    e.slot_s += (nxt - run_from) * len(e.running)
            while e.running and e.running[0][0] <= e.tau + 1e-6:
                _, _, s = heapq.heappop(e.running)
                finish_seq(e, s)
            start_queued(e)
        now = nxt
    now = max(now, trainer_busy_until)  # the last update ends the run
    gen = [n for step in sorted(generated) if step <= steps for n in generated[step]]
    return Result(k, now, steps, total_tokens, trainer_idle, sum(e.busy_s for e in engines) / (now * len(engines)),
                  sum(e.slot_s for e in engines) / (now * len(engines) * c.slots), staleness, gen, trained_lengths, max_in_flight)
