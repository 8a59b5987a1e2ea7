"""Bounded staleness: which step's batch may be sampled now, in what order batches are trained,
and the bound every trained token keeps (`rollout.max_staleness` = k).

The policy version v is the step whose weights the engines hold: θ_v after v updates (a sync sets
it; a resumed run starts at its checkpoint's step). Step s trains θ_{s-1} on a batch sampled
ahead; a token sampled by θ_v is s − 1 − v updates stale. A batch for step s is admitted only
once the engines hold θ_{s-1-k}, so every token of it, sampled then or later, is at most k
stale; batches are trained in the order admitted and none is dropped; `take` checks the bound
again on what the engine says sampled each token. k = 0 is synchronous: a batch is admitted only
after the sync of the step before. At most k + 1 batches are admitted and not yet trained.

Nothing here knows an engine, a process or a clock: Rollouts drives it with a vLLM engine, the
tests with a fake one, tests/async_sim.py with simulated engines on a simulated clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any


class StalenessError(RuntimeError):
    """A batch about to be trained holds a token more than k updates stale (a bug: admission
    should have made it impossible), or out of order."""


@dataclass
class Ticket:
    """One step's batch, from admission to training."""

    step: int  # the step that trains on it
    admitted: int  # the policy version the engines held when it was admitted
    position: Any  # the prompt sampler's state before its prompts were drawn (what a resume draws again)
    handle: Any = None  # the engine's: a request under way, then its answer
    done: bool = False
    tokens: dict[int, int] = field(default_factory=dict)  # policy version → tokens it sampled

    def staleness(self) -> dict[int, int]:
        """Updates behind the trained weights (step − 1 − version) → tokens."""
        return {self.step - 1 - v: n for v, n in sorted(self.tokens.items())}


class Controller:
    def __init__(self, max_staleness: int, *, step: int, version: int | None = None):
        """`step`: the last step trained (0 for a new run); the engines hold θ_`version`
        (default: that step's weights)."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness = {max_staleness}; it must be ≥ 0")
        self.k = max_staleness
        self.version = step if version is None else version
        self.trained = step  # the last step taken
        self._queue: collections.deque[Ticket] = collections.deque()  # admitted, not trained, in step order

    # ----- admission ----------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step the next admitted batch is for."""
        return (self._queue[-1].step if self._queue else self.trained) + 1

    def may_admit(self) -> bool:
        """Whether the next step's batch may be sampled now: the engines hold θ_{s-1-k} or newer."""
        return self.next_step - 1 - self.k <= self.version

    def admit(self, position: Any, handle: Any = None) -> Ticket:
        if not self.may_admit():
            raise StalenessError(f"step {self.next_step}'s batch admitted at version {self.version}: more than "
                                 f"{self.k} updates behind the weights it would train")
        ticket = Ticket(self.next_step, self.version, position, handle)
        self._queue.append(ticket)
        return ticket

    def finish(self, ticket: Ticket, answer: Any = None, tokens: dict[int, int] | None = None) -> None:
        """A batch's sampling is over; `tokens`: how many tokens each policy version sampled (by
        default all by the version it was admitted at: an engine that applies no update mid-batch)."""
        ticket.handle, ticket.done = answer, True
        ticket.tokens = dict(tokens) if tokens is not None else {ticket.admitted: 0}

    # ----- training -----------------------------------------------------------------------------
    def head(self) -> Ticket | None:
        """The batch the next step trains on (under way or done), if admitted."""
        return self._queue[0] if self._queue else None

    def take(self, step: int) -> Ticket:
        """Step `step`'s finished batch, out of the queue, after checking the bound on each token."""
        if not self._queue or self._queue[0].step != step or not self._queue[0].done:
            have = self._queue[0] if self._queue else None
            raise StalenessError(f"step {step} asked for its batch; the queue's head is "
                                 f"{'nothing' if have is None else f'step {have.step} (done: {have.done})'}")
        ticket = self._queue[0]
        worst = max((s for s in ticket.staleness()), default=0)
        if worst > self.k or ticket.admitted < step - 1 - self.k:
            raise StalenessError(f"step {step}'s batch holds tokens {worst} updates stale (admitted at version "
                                 f"{ticket.admitted}); the bound is {self.k}")
        self._queue.popleft()
        self.trained = step
        return ticket

    def updated(self, version: int) -> None:
        """The engines now hold θ_`version` (a sync)."""
        if version < self.version:
            raise ValueError(f"version {version} after {self.version}: a rollback goes through `discard`")
        self.version = version

    def discard(self) -> list[Ticket]:
        """A rollback: every batch admitted and not trained was sampled (or would be) by weights it
        undoes, so all go; the engines then get the restored weights, which the next step trains
        (the version of the last step trained: step numbers go on). Returns them (an engine drops
        what it still has under way)."""
        gone = list(self._queue)
        self._queue.clear()
        self.version = self.trained
        return gone

    # ----- what a checkpoint records ------------------------------------------------------------
    def position(self, now: Any) -> Any:
        """The prompt sampler's state a checkpoint after the last trained step records: before the
        oldest batch admitted and not trained (a resume draws those prompts again), else `now`."""
        return self._queue[0].position if self._queue else now

    def __len__(self) -> int:
        """Batches admitted and not trained (under way or done)."""
        return len(self._queue)
