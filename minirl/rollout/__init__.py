"""Everything that serves rollouts, behind one object: `Rollouts`. vLLM is imported only in this package.

    engine.py    the engine's contract (`Engine`, `Completion`) and its in-process build;
                 `make_engine` here is the one factory every caller uses
    vllm.py      the vLLM engine (its CPU and CUDA arguments from one function: vllm_args.py)
    vllm_internals.py  the one door to vLLM's non-public parts (the scheduler's preemptions, request ids,
                 the runner's hooks, the sampler's log-probs), each named and checked before an engine starts
    lifetime.py  in-process engines share the process's parallel groups: the last one alive tears them down
    controller.py  bounded staleness: which step's batch may be sampled now, in what order batches
                 are trained, the bound every trained token keeps (`rollout.max_staleness`)
    process.py   the engine in a process of its own (`rollout.max_staleness` ≥ 1; syncs queued, or
                 loaded between two forward steps with `rollout.inflight_updates`)
    serve.py     that process's loop: the engine built, its calls answered in order
    sync.py      trainer → engine weights (bucketed streams; direct writes on CPU)
    broadcast.py the same across processes: a group of their own (gloo; NCCL between GPUs)
    remote.py    engines on rollout GPUs of their own (`parallel.rollout_gpus`), started by each node's
                 first rank, which splits calls over them, sends each rank its share, broadcasts syncs
    fp8.py       FP8 weights through torchao (emulated where there are no FP8 kernels)
    seeding.py   one generator seed per `generate` call
    episodes.py  multi-turn episodes: the turn loop over an engine and a task's environments, token in,
                 token out (sampled ids verbatim, only replies tokenized; R3 rows across turns); at k ≥ 1
                 the engine's process runs it in its stream, an episode's turns at their own pace
    environments.py  a recipe's [env] as the rollouts use it: a batch's episodes built (rows, seeds,
                 ids), sampled here or sent to an engine's process; a step's rows of its episodes
    stream.py    an engine's calls as requests in flight (`generate` is a stream of one call); with
                 `rollout.inflight_updates` the engine's process keeps stepping across calls
    cpu/         CPU-only pieces inside the engine: weights, norms, log-probs, routes; stale shm segments

The loop asks for a step's batch (`next`), hands over the trainer after an update (`sync`), and
borrows the engine for scoring and evaluation (`score`, `generate`). Whether the engine runs in
this process, samples ahead in its own while the trainer trains, or runs on rollout GPUs of its
own is decided here, once, from the recipe: the loop never learns which (it asks `group_ranks`
which ranks send the same requests).

May import: the top-level modules, the base rooms (disk, models, envs, data, config) and train (the HF names of the trainer's weights). Must not
import setup, eval, run, publish, lab or cli.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from minirl.data.prompts import PromptSampler
from minirl.models import sizing
from minirl.proc.collector import collect_as_usual
from minirl.rollout import sync as weight_sync
from minirl.rollout.controller import Controller, StalenessError, Ticket
from minirl.rollout.engine import Completion, Engine, Truncation, build
from minirl.rollout.process import start_engine_process
from minirl.rollout.remote import RemoteEngines
from minirl.rollout.seeding import top_up_seed

if TYPE_CHECKING:  # annotations only
    from minirl.launch import World
    from minirl.stopwatch import Stopwatch

__all__ = ["Completion", "Engine", "Rollouts", "make_engine"]


def make_engine(model_dir: Path, rollout, *, seed: int, max_model_len: int, own_process: bool = False,
                **settings) -> Engine:
    """The one factory of rollout engines, for every caller (the run, eval, export, the doctor): the
    engine the recipe's [rollout] section names (minirl/config/engines.py), for `model_dir`, in this process
    or with `own_process` in a process of its own on half of this one's cores (`rollout.max_staleness`
    ≥ 1: process.py). `settings` add to or replace what [rollout] says."""
    if own_process:
        engine = start_engine_process(model_dir, rollout, seed=seed, max_model_len=max_model_len, **settings)
    else:
        engine = build(model_dir, rollout, seed=seed, max_model_len=max_model_len, **settings)
    collect_as_usual()  # the start's imports are done (minirl/proc/collector.py)
    return engine


class Rollouts:
    """A step's prompts and their G sampled completions each, at most `rollout.max_staleness` = k
    updates behind the weights the step trains (controller.py).

    k = 0 (the default): `next(step)` samples the step's batch from the weights just synced, in
    this process. k ≥ 1: the engine runs in a process of its own and samples ahead while the
    trainer trains: `next(step)` returns the batch admitted for this step and admits every next
    one the bound allows; a sync is queued behind the batches already sent (the engine applies it
    between two of them, and the trainer does not wait for it), so each batch is sampled by the
    weights of the syncs sent before it: a version known when it is admitted. k = 1 samples the
    next step's batch while this one trains (one step off-policy). Each rank gets its share of
    the prompts; ranks of one tensor-parallel group sample together.

    Time spent waiting on the engine is booked on the run's stopwatch: "rollout" for sampling,
    "sync" for weights being written.
    """

    def __init__(self, engine, *, sampler: PromptSampler, world: World, rollout, train, clock: Stopwatch,
                 episodes=None):
        self._engine, self._sampler, self._world, self._clock = engine, sampler, world, clock
        # multi-turn: `episodes.sample(engine, problems, **generate's settings)` samples a batch (environments.py)
        self._episodes = episodes
        self._rollout, self._train = rollout, train
        self._k = rollout.max_staleness
        self._remote = isinstance(engine, RemoteEngines)  # engines on rollout GPUs of their own
        # ranks that send one engine the same requests, each keeping its part of the answers: a
        # tensor-parallel group beside the trainer, or a node's training ranks (its first asks its engines)
        self._tp = engine.ranks if self._remote else rollout.tensor_parallel
        self._control = Controller(self._k, step=0)
        self._taken: Ticket | None = None  # the batch of the step under way
        # k ≥ 1, since the last metrics row: (its time, the engine's busy seconds, the trainer's waits then)
        self._since: tuple[float, float, float] | None = None
        # (wall, engine busy, trainer waits) since the RL loop began that were off its clock: the
        # engine's start and the held-out evaluations (`generate`), never counted in a row
        self._off = (0.0, 0.0, 0.0)
        self._cancelled: tuple[int, int] | None = None  # a rollback's: (batches discarded, of them dropped unanswered)
        # dynamic sampling's extra prompts: a stream of their own (seed −1 − train.seed, which no run's
        # main sampler has), so the steps' batches draw what they would without it, and a resume too
        self._top_ups: PromptSampler | None = None
        self._trained: dict[int, int] | None = None  # the step's tokens by version, where `trains` chose them

    @classmethod
    def from_recipe(cls, rec, model_dir: Path, *, trainer, sampler: PromptSampler, world: World,
                    clock: Stopwatch, memory_fraction: float | None = None,
                    kv_cache_gib: float | None = None, sleep_level: int | None = None, episodes=None) -> "Rollouts":
        """The engine the recipe asks for, holding the trainer's current weights. `memory_fraction`
        and `kv_cache_gib`: its share of the GPU and its KV cache as the run's plan derived them
        (preflight), instead of the recipe's: given its KV cache's size, vLLM skips the profiling
        pass that captures every CUDA graph once before the real capture (#73). `sleep_level`: the
        plan's where the recipe left it to the plan (rollout.sleep_level = -1)."""
        p, tp = rec.parallel, rec.rollout.tensor_parallel
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # this node's training ranks
        per_node = p.rollout_gpus // tp  # engines on each node's rollout GPUs
        engines = per_node * world.size // local if p.rollout_gpus else world.size // tp
        kw = dict(seed=rec.train.seed, max_model_len=sizing.max_model_len(rec), capture_routes=rec.train.replay == "r3",
                  max_num_seqs=sizing.max_num_seqs(rec, engines))
        if memory_fraction is not None:
            kw["memory_fraction"] = memory_fraction
        if kv_cache_gib:
            kw["kv_cache_gib"] = kv_cache_gib
        if sleep_level is not None:
            kw["sleep_level"] = sleep_level
        if p.rollout_gpus:  # each node's, on the GPUs after its training ranks', asked by its first rank
            engine = RemoteEngines(model_dir, rec.rollout, world=world.part(local), engines=per_node,
                                   first_stream=world.rank // local * per_node, **kw)
        else:
            engine = make_engine(model_dir, rec.rollout, own_process=rec.rollout.max_staleness > 0, **kw)
        rollouts = cls(engine, sampler=sampler, world=world, rollout=rec.rollout, train=rec.train, clock=clock,
                       episodes=episodes)
        rollouts.sync(trainer)  # resumed weights, or FP8-rounded ones; the same weights otherwise
        return rollouts

    @property
    def startup(self) -> dict[str, float]:
        """Seconds of the engine's start vLLM spent compiling and capturing CUDA graphs (`compile`,
        `graphs`), where the engine is in this process; else nothing."""
        got = getattr(self._engine, "startup", None) or {}
        return {k: round(got[f"{k}_s"], 2) for k in ("compile", "graphs") if f"{k}_s" in got}

    @property
    def group_ranks(self) -> int:
        """Ranks that ask for the same prompts and each keep their part (`World.group_share` /
        `member_share`): rollout.tensor_parallel, or a node's training ranks with rollout GPUs."""
        return self._tp

    def record(self) -> dict:
        """The rollouts' part of a checkpoint's record: the prompt sampler's state after the steps
        trained. Batches admitted ahead are not counted; a resumed run draws their prompts again.
        Dynamic sampling's stream is drawn within a step: its state is the steps' own."""
        return {"sampler": self._control.position(self._sampler.state()),
                **({"top_ups": self._top_ups.state()} if self._top_ups is not None else {})}

    def restore(self, record: dict) -> None:
        """Where a checkpoint's run was in its prompts and steps (before anything is sampled)."""
        if len(self._control):
            raise RuntimeError("rollouts restored after a batch was admitted")
        self._sampler.restore(record["sampler"])
        if "top_ups" in record:  # else none was drawn yet: the stream starts afresh
            self._top_up_stream().restore(record["top_ups"])
        self._control = Controller(self._k, step=record["step"])  # the engine holds that step's weights ...
        self._engine.set_version(record["step"])  # ... and stamps what it samples with its number

    def next(self, step: int) -> tuple[list, list[list[Completion]]]:
        """This step's problems and their G completions each (this rank's share of both)."""
        if self._k and self._since is None:
            self._off = (time.perf_counter(), self._engine.busy_s, self._engine.waited_s)  # the start: off the clock
            self._since = (0.0, 0.0, 0.0)
        if self._control.head() is None:  # nothing ahead: a new run, k = 0, after a rollback
            self._admit()
        head = self._control.head()
        if not head.done:  # k ≥ 1: under way in the engine's process
            asked, handle = head.handle
            answer, tokens = self._answer(handle, head.admitted)  # a wait the engine's process books
            self._control.finish(head, (asked, answer), tokens=tokens)
        self._taken = ticket = self._control.take(step)
        self._trained = None
        # what the bound allows, sampled while this step trains; never a batch past the run's last step
        while self._k and self._control.may_admit() and self._control.next_step <= self._train.steps:
            self._admit()
        self._engine.sleep()  # frees its memory for training (CUDA); the sync wakes it
        return self._kept(*ticket.handle)

    def top_up(self, step: int, draw: int) -> tuple[list, list[list[Completion]]]:
        """Dynamic sampling's `draw`-th extra batch for `step` (its problems and G completions each):
        prompts_per_step prompts of its own stream, sampled now by the weights last synced (k ≥ 1:
        behind the batches sent before it, so its tokens are fresher than the step's own batch)."""
        asked = self._world.group_share(self._top_up_stream().next_batch(self._train.prompts_per_step), self._tp)
        args, kw = self._request(asked, seed=top_up_seed(self._train.seed, step, draw))
        if self._k or self._remote:
            answer, _ = self._answer(self._engine.submit("generate", *args, **kw), self._control.version)
        else:
            answer = self._sample(asked, args, kw)
        return self._kept(asked, answer)

    def _sample(self, asked: list, args: tuple, kw: dict) -> list[list[Completion]]:
        """A batch sampled in this process: one `generate`, or multi-turn episodes over the engine."""
        if self._episodes is not None:
            return self._episodes.sample(self._engine, asked, **kw)
        return self._engine.generate(*args, **kw)

    def _request(self, asked: list, *, seed: int) -> tuple[tuple, dict]:
        """A batch's `generate` call: G responses to each prompt asked, at the recipe's sampling (G
        episodes each, run by the engine's process at k ≥ 1 and on rollout GPUs: stream.py)."""
        ro = self._rollout
        cuts = Truncation.of(ro)  # the sampler's, recorded with each token
        kw = dict(n=self._train.group_size, temperature=ro.temperature, max_tokens=ro.max_tokens, seed=seed, **cuts.kw)
        if self._episodes is not None and (self._k or self._remote):  # run by the engines' processes
            kw["episodes"] = self._episodes.request(asked, seed=seed)
        return ([p.prompt_ids for p in asked],), kw

    def _kept(self, asked: list, answer: list) -> tuple[list, list[list[Completion]]]:
        """This rank's share of a batch's problems and answers (rollout GPUs: the answer is its own already)."""
        mine = self._world.member_share
        return mine(asked, self._tp), answer if self._remote else mine(answer, self._tp)

    def _top_up_stream(self) -> PromptSampler:
        if self._top_ups is None:
            self._top_ups = PromptSampler(self._sampler.problems, seed=-1 - self._sampler.seed)
        return self._top_ups

    def trains(self, groups: list[list[Completion]]) -> None:
        """The groups the step trains, where they are not its batch as sampled (dynamic sampling):
        its staleness, for the guard and the rows, is theirs."""
        if self._k:
            self._trained = _by_version(groups, self._control.version)
            worst = max((self._taken.step - 1 - v for v in self._trained), default=0)
            if worst > self._k:
                raise StalenessError(f"step {self._taken.step} trains tokens {worst} updates stale; the bound is {self._k}")

    def _staleness(self) -> dict[int, int]:
        """The step's trained tokens by updates behind the trained weights."""
        if self._trained is None:
            return self._taken.staleness()
        return {self._taken.step - 1 - v: n for v, n in sorted(self._trained.items())}

    def lag(self) -> float:
        """The mean staleness of the step's batch, in updates (0 at k = 0): what the guard allows."""
        if not self._k or self._taken is None:
            return 0.0
        lags = self._staleness()
        n = sum(lags.values())
        return sum(lag * c for lag, c in lags.items()) / n if n else 0.0

    def metrics(self) -> dict:
        """The step's batch: requests preempted (the KV cache ran short) and, with R3, samples drawn
        again because of it (only when there were any). k ≥ 1 (at k = 0 every token is 0 stale):
        updates behind the trained weights, mean and max over its tokens and their histogram; the
        batches admitted ahead; since the last row, the shares of the wall time the engine had
        nothing to do and the trainer waited on it."""
        if self._taken is None:
            return {}
        comps = [c for g in self._taken.handle[1] for c in g]  # this rank's rollout group's
        counts = {"rollout/preempted": sum(c.preempted for c in comps),
                  "rollout/regenerated": sum(c.regenerated for c in comps)}
        if self._world.size > 1:  # every engine's: summed over ranks, each group counted once
            once = 1 if self._remote else self._tp  # rollout GPUs: each rank holds a share of the batch
            counts = {k: v // once for k, v in self._world.mean(counts, sums=tuple(counts)).items()}
        out = counts if any(counts.values()) else {}
        if self._cancelled is not None:  # the row of a rollback: what it threw away, and the engine never finished
            out |= {"rollout/batches_discarded": self._cancelled[0], "rollout/batches_cancelled": self._cancelled[1]}
            self._cancelled = None
        if not self._k:
            return out
        lags = self._staleness()  # updates behind → tokens
        # one definition, every bench's and the live table's: the engine idle outside its calls, the
        # trainer idle while blocked on the engine, for whatever reason (the batch, a snapshot slot,
        # a parity check's settle, a rollback's drain)
        now, busy, waits = self._on_clock()
        then, busy_then, waits_then = self._since  # set by the first `next`
        wall = max(now - then, 1e-9)
        self._since = (now, busy, waits)
        return out | {"rollout/staleness_mean": self.lag(),
                      "rollout/staleness_max": max(lags),
                      "rollout/staleness_tokens": [lags.get(lag, 0) for lag in range(self._k + 1)],  # histogram 0…k
                      "rollout/batches_ahead": len(self._control),
                      "timing/engine_busy_s": round(busy, 4),
                      "timing/trainer_wait_s": round(waits, 4),
                      # an engine's call is counted when it is answered: one row may count a call begun before it
                      "timing/engine_idle_frac": round(max(0.0, 1 - (busy - busy_then) / wall), 4),
                      "timing/trainer_idle_frac": round(min(1.0, (waits - waits_then) / wall), 4)}

    def sync(self, trainer) -> None:
        """The trainer's weights into the engine, in place (sync.py); k ≥ 1: queued behind the
        batches sent before it, which it does not change."""
        if self._remote:  # by broadcast to the rollout GPUs; taken by each engine behind the batches sent before
            weight_sync.broadcast(trainer, self._engine, bucket_bytes=self._rollout.sync_bucket_mib * 2**20,
                                  version=self._control.trained)
        elif self._k:
            # a slot per sync that may wait behind batches sent before it: at most k, and no more than the run's steps
            weight_sync.queue(trainer, self._engine, bucket_bytes=self._rollout.sync_bucket_mib * 2**20,
                              slots=max(1, min(self._k, self._train.steps)), version=self._control.trained)
        else:
            weight_sync.sync(trainer, self._engine, bucket_bytes=self._rollout.sync_bucket_mib * 2**20,
                             version=self._control.trained)
        self._control.updated(self._control.trained)

    def discard(self) -> None:
        """A rollback: forget the batches admitted ahead (sampled, or to be, by weights it undoes;
        their prompts are not drawn again), and have the engine drop those it has not answered,
        queued or under way, so that the restored weights sample next instead of behind them (#74)."""
        gone = self._control.discard()
        under_way = [t.handle[1] for t in gone if not t.done and t.handle is not None]
        cancel = getattr(self._engine, "cancel", None)  # an engine in a process of its own
        self._cancelled = (len(gone), cancel(under_way) if cancel and under_way else 0)

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """log μ of given response tokens under the weights last synced (once they are written whole)."""
        self._engine.settle()
        self._clock.lap("sync")
        return self._engine.score(prompts, responses)

    def generate(self, prompts: Sequence[Sequence[int]], **kw) -> list[list[Completion]]:
        """The engine's own `generate` (held-out evaluation, fixed parity pairs): after the batches
        and syncs sent before it, so under the weights last synced. Off the RL clock: its wall time,
        and the engine's and the trainer's seconds in it, are left out of the rows' timing."""
        if self._since is None:  # before the loop, or k = 0 (no engine's process to time)
            return self._engine.generate(prompts, **kw)
        t0, busy0, waits0 = time.perf_counter(), self._engine.busy_s, self._engine.waited_s
        try:
            return self._engine.generate(prompts, **kw)
        finally:
            w, b, t = self._off
            self._off = (w + time.perf_counter() - t0, b + self._engine.busy_s - busy0, t + self._engine.waited_s - waits0)

    def _on_clock(self) -> tuple[float, float, float]:
        """(wall seconds, the engine's busy seconds, the trainer's waits on it) on the RL clock: since
        the loop began, less what was off it."""
        w, b, t = self._off
        return time.perf_counter() - w, self._engine.busy_s - b, self._engine.waited_s - t

    def close(self) -> None:
        """Stop the engines' processes (k ≥ 1, rollout GPUs; an in-process engine ends with this process)."""
        if self._k or self._remote:
            self._engine.close()

    def _admit(self) -> None:
        """Draw the next step's prompts and sample G responses to each: the same draw on every
        rank; each rollout (TP) group generates its share. k ≥ 1: sent to the engine's process,
        which samples it while this one goes on."""
        position = self._sampler.state()
        asked = self._world.group_share(self._sampler.next_batch(self._train.prompts_per_step), self._tp)
        ticket = self._control.admit(position)
        args, kw = self._request(asked, seed=self._train.seed * 1_000_003 + ticket.step)
        if self._k:
            ticket.handle = (asked, self._engine.submit("generate", *args, **kw))
        elif self._remote:
            answer, tokens = self._answer(self._engine.submit("generate", *args, **kw), ticket.admitted)
            self._control.finish(ticket, (asked, answer), tokens=tokens)
        else:
            self._control.finish(ticket, (asked, self._sample(asked, args, kw)))

    def _answer(self, handle, admitted: int) -> tuple[list, dict[int, int]]:
        """A batch's answer as this rank keeps it (its rollout group's; with rollout GPUs its own
        share alone), and the whole batch's tokens by the version that sampled them."""
        if not self._remote:
            answer = _stamped(self._engine.result(handle), admitted)
            return answer, _by_version(answer, admitted)
        answer = _stamped(self._engine.result(handle, share=True), admitted)
        tokens: dict[int, int] = {}
        for part in self._world.gather([_by_version(answer, admitted)]):
            for version, n in part.items():
                tokens[version] = tokens.get(version, 0) + n
        return answer, tokens


def _stamped(groups: list[list[Completion]], admitted: int) -> list[list[Completion]]:
    """Each token's version, where the engine stamped none: the version the batch was admitted at
    (an engine that applies no update mid-batch). The loss reads them (a token behind is clipped
    against its sampler: objective.sampler_logp)."""
    return [[c if c.versions is not None else dataclasses.replace(c, versions=(admitted,) * len(c.token_ids))
             for c in g] for g in groups]


def _by_version(groups: list[list[Completion]], admitted: int) -> dict[int, int]:
    """Tokens of a batch (stamped) by the policy version that sampled them (an episode's environment
    tokens, sampled by none, left out)."""
    out: dict[int, int] = {}
    for c in (c for g in groups for c in g):
        for v, m in zip(c.versions, c.mask or (1,) * len(c.versions)):
            if m:
                out[v] = out.get(v, 0) + 1
    return out or {admitted: 0}
