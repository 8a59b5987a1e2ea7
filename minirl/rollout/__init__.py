"""Everything that serves rollouts, behind one object: `Rollouts`. vLLM is imported only in this package.

    engine.py    the engine's contract (`Engine`, `Completion`) and its in-process build;
                 `make_engine` here is the one factory every caller uses
    vllm.py      the vLLM engine (CPU and CUDA arguments from one function, `engine_args`)
    process.py   the engine in a process of its own (`rollout.overlap`)
    sync.py      trainer → engine weights (bucketed streams; direct writes on CPU)
    fp8.py       FP8 weights through torchao (emulated where there are no FP8 kernels)
    seeding.py   one generator seed per `generate` call
    cpu/         CPU-only pieces inside the engine: weights, norms, log-probs, routes

The loop asks for a step's batch (`next`), hands over the trainer after an update (`sync`), and
borrows the engine for scoring and evaluation (`score`, `generate`). Whether the engine runs in
this process or samples the next batch in its own while this one trains is decided here, once,
from the recipe: the loop never learns which.

May import: the top-level modules and train (the HF names of the trainer's weights). Must not
import setup, eval, run, publish, lab or cli.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from minirl import engine_sizing as sizing
from minirl.rollout import sync as weight_sync
from minirl.rollout.engine import Completion, Engine, build
from minirl.rollout.process import start_overlapped

if TYPE_CHECKING:  # annotations only
    from minirl.data import PromptSampler
    from minirl.launch import World
    from minirl.stopwatch import Stopwatch

__all__ = ["Completion", "Engine", "Rollouts", "make_engine"]


def make_engine(model_dir: Path, rollout, *, seed: int, max_model_len: int, own_process: bool = False,
                **settings) -> Engine:
    """The one factory of rollout engines, for every caller (the run, eval, export, the doctor): the
    engine the recipe's [rollout] section names (minirl/engines.py), for `model_dir`, in this process
    or with `own_process` in a process of its own on half of this one's cores (`rollout.overlap`:
    process.py). `settings` add to or replace what [rollout] says."""
    if own_process:
        return start_overlapped(model_dir, rollout, seed=seed, max_model_len=max_model_len, **settings)
    return build(model_dir, rollout, seed=seed, max_model_len=max_model_len, **settings)


class Rollouts:
    """A step's prompts and their G sampled completions each, from the weights last synced.

    In-process (the default), `next(step)` samples the step's batch from the current weights. With
    `rollout.overlap` the engine runs in its own process and `next(step)` returns the batch it
    sampled while the step before trained (one step off-policy), then starts the next one at once.
    Each rank gets its share of the prompts; ranks of one tensor-parallel group sample together.

    Time spent waiting on the engine is booked on the run's stopwatch: "rollout" for sampling,
    "sync" for weights being written.
    """

    def __init__(self, engine, *, sampler: PromptSampler, world: World, rollout, train, clock: Stopwatch):
        self._engine, self._sampler, self._world, self._clock = engine, sampler, world, clock
        self._rollout, self._train = rollout, train
        self._overlap = rollout.overlap
        self._tp = rollout.tensor_parallel
        self._pending = None  # overlapped: (prompts, answer handle) of the next step's batch, under way
        self._position = None  # overlapped: the sampler's state before the batch under way was drawn

    @classmethod
    def from_recipe(cls, rec, model_dir: Path, *, trainer, sampler: PromptSampler, world: World,
                    clock: Stopwatch, memory_fraction: float | None = None) -> "Rollouts":
        """The engine the recipe asks for, holding the trainer's current weights. `memory_fraction`:
        its share of the GPU as the run's plan derived it (preflight), instead of the recipe's."""
        kw = dict(seed=rec.train.seed, max_model_len=sizing.max_model_len(rec), capture_routes=rec.train.replay == "r3",
                  max_num_seqs=sizing.max_num_seqs(rec, world.size // rec.rollout.tensor_parallel))
        if memory_fraction is not None:
            kw["memory_fraction"] = memory_fraction
        engine = make_engine(model_dir, rec.rollout, own_process=rec.rollout.overlap, **kw)
        if rec.rollout.overlap:
            trainer.share_memory()  # the engine's process copies the weights from here at each sync
        rollouts = cls(engine, sampler=sampler, world=world, rollout=rec.rollout, train=rec.train, clock=clock)
        rollouts.sync(trainer)  # resumed weights, or FP8-rounded ones; the same weights otherwise
        return rollouts

    def record(self) -> dict:
        """The rollouts' part of a checkpoint's record: the prompt sampler's state after this step's
        prompts. The batch sampled ahead is not counted; a resumed run draws its prompts again."""
        return {"sampler": self._position if self._pending is not None else self._sampler.state()}

    def restore(self, record: dict) -> None:
        """Where a checkpoint's run was in its prompts (before anything is sampled)."""
        assert self._pending is None, "restored after the first batch was drawn"
        self._sampler.restore(record["sampler"])

    def next(self, step: int) -> tuple[list, list[list[Completion]]]:
        """This step's problems and their G completions each (this rank's share of both)."""
        self._engine.settle()  # overlapped: the engine's share of the last sync, written while the step before ended
        self._clock.lap("sync")
        asked, answer = self._pending or self._sample(step)
        self._pending = None
        if self._overlap:
            answer = self._engine.result(answer)
            self._position = self._sampler.state()
            self._pending = self._sample(step + 1)
        self._engine.sleep()  # frees its memory for training (CUDA); the sync wakes it
        mine = self._world.member_share
        return mine(asked, self._tp), mine(answer, self._tp)

    def sync(self, trainer) -> None:
        """The trainer's weights into the engine, in place (sync.py). Overlapped, the batch under
        way is finished first: it was sampled from the weights before this update."""
        self._finish_pending()
        weight_sync.sync(trainer, self._engine, bucket_bytes=self._rollout.sync_bucket_mib * 2**20)

    def discard(self) -> None:
        """Forget the batch sampled ahead (from weights a rollback undoes; the prompts are not
        drawn again) and wait until the engine reads nothing of the trainer's parameters."""
        self._finish_pending()
        self._pending = None
        self._engine.settle()

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """log μ of given response tokens under the weights last synced (once they are written whole)."""
        self._engine.settle()
        self._clock.lap("sync")
        return self._engine.score(prompts, responses)

    def generate(self, prompts: Sequence[Sequence[int]], **kw) -> list[list[Completion]]:
        """The engine's own `generate` (held-out evaluation, fixed parity pairs)."""
        return self._engine.generate(prompts, **kw)

    def close(self) -> None:
        """Stop the engine's process (overlapped; an in-process engine ends with this process)."""
        if self._overlap:
            self._engine.close()

    def _sample(self, step: int) -> tuple[list, list]:
        """Draw a step's prompts and sample G responses to each: the same draw on every rank; each
        rollout (TP) group generates its share. Overlapped, the answer is a handle the engine's
        process fills in while this process goes on."""
        asked = self._world.group_share(self._sampler.next_batch(self._train.prompts_per_step), self._tp)
        args = ([p.prompt_ids for p in asked],)
        kw = dict(n=self._train.group_size, temperature=self._rollout.temperature,
                  max_tokens=self._rollout.max_tokens, seed=self._train.seed * 1_000_003 + step)
        if self._overlap:
            return asked, self._engine.submit("generate", *args, **kw)
        return asked, self._engine.generate(*args, **kw)

    def _finish_pending(self) -> None:
        """Overlapped: wait for the batch under way (what of it the update did not hide)."""
        if self._pending is not None:
            self._engine.result(self._pending[1])
            self._clock.lap("rollout")
