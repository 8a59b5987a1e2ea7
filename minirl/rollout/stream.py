"""An engine that keeps stepping across calls (`rollout.inflight_updates`): the batches of several
steps sampled together by one vLLM engine, so the engine does not wait for a batch's longest
response before it starts the next batch's requests (continuous batching across steps, what the
cluster simulation of docs/results/async.md models), and a sync that comes in is loaded between
two forward steps while the requests in flight go on.

`Stream.add` puts a call's requests into the running engine at once; `Stream.step` runs one
forward step and returns the calls whose requests have all finished, their completions cut from
the captures (log μ, versions, R3 routes: rollout/cpu/) while the others go on. A request the
scheduler preempted keeps its tokens and log μ but, with R3, not its routes: that sample is asked
again as a request of its own, and its call waits for it (`Completion.regenerated`). A call's
seed seeds the process's generators when it comes to an idle engine, and they get their state back
when it is idle again: alone, a call repeats; beside others, its noise depends on theirs (with
in-flight updates a run does not repeat exactly anyway).

A call of multi-turn episodes (`add(..., episodes=)`, episodes.py) is answered when its episodes
have all ended and their environments closed: each episode's first turn is asked as soon as its
environment started, each next turn as soon as its environment answered the last one's call (its
log μ, versions and routes cut from the captures when it finished), so a sync that comes in between
two turns, or within one, samples the rest of that episode, and each token says which weights
sampled it. The environments run on their own workers (minirl/envs/hosting.py), a batch's at once;
with in-flight updates the engine steps meanwhile (a slow tool holds back its own episode, not the
engine); without, each forward step waits for the calls of the turns it ended, so that a seeded run
asks the same requests at the same steps and repeats exactly.

`VLLMEngine.generate` is a stream of one call; the engine's process (process.py) keeps one across
calls (`rollout.inflight_updates`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

from minirl.rollout import vllm_internals
from minirl.rollout.cpu import logprobs as cpu_logprobs
from minirl.rollout.cpu import routes as cpu_routes
from minirl.rollout.engine import NO_CUT, Completion, Truncation
from minirl.rollout.seeding import call_seed, request_seed, seeded_sampling


@dataclass
class _Call:
    params: dict  # temperature, stop, truncation
    groups: list[list]  # [prompt][n]: the completions as their requests finish
    seed: int | None = None  # seeded requests: the call's base seed (a prompt's is base + its index)
    turns: object = None  # multi-turn: its episodes (episodes.Turns), asked each next turn
    waiting: int = 0  # its requests in flight
    redrawn: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (prompt, completion, turn) → draws thrown away


@dataclass(frozen=True)
class _Request:
    tag: int  # its call's
    i: int  # the call's prompt it answers
    slot: int | None  # its completion of that prompt (None: all n)
    prompt: list[int]  # what it is asked to continue (an episode's turn: the episode so far)
    budget: int  # its max_tokens
    turn: int = 0  # an episode's turn


class Stream:
    def __init__(self, engine, *, max_redraws: int, overlap_envs: bool = False):
        self.engine, self.max_redraws = engine, max_redraws
        # with in-flight updates the engine steps while environments work (a run does not repeat
        # exactly anyway); without, each forward step waits for the calls its turns ended with, so
        # that what is asked, and when, is the same in every run of a seed
        self.overlap_envs = overlap_envs
        self._llm = engine._llm
        self._calls: dict[int, _Call] = {}
        self._owner: dict[str, _Request] = {}  # request id → what it answers
        self._open = contextlib.ExitStack()  # while busy: the seeded generators, the preemption watch
        self._preempted: dict[tuple[str, int], int] = {}
        # each token's policy version, from the syncs seen between forward steps (CUDA's stamps; the
        # CPU capture stamps its own): a request's version when asked, and (tokens sampled before, the
        # version after) at each sync while it ran
        self._asked_at: dict[str, int] = {}
        self._marks: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._seen = 0  # the engine's version at the last forward step
        self._hosts: set = set()  # the environments' hosts of the calls answered since the engine was last idle

    @property
    def busy(self) -> bool:
        return bool(self._calls)

    def add(self, tag: int, prompts, *, n: int, temperature: float, max_tokens, seed: int | None = None,
            seeded_requests: bool = False, stop=(), episodes=None, truncation: Truncation = NO_CUT) -> None:
        """Call `tag`'s n samples of each prompt, into the engine at once (between two forward steps).
        `seeded_requests`: prompt i's samples drawn from a generator of their own, seeded from the
        call's seed and i, whatever else is in flight or how many sequences the engine schedules.
        `episodes` (environments.EpisodeRequest): n episodes of each prompt, each turn after the first
        asked as its last one finishes; the call's answer is the episodes."""
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompts):
            raise ValueError(f"{len(budgets)} max_tokens for {len(prompts)} prompts")
        turns = None
        if episodes is not None:  # its environments started on their workers; each episode asked once its own has
            turns = episodes.turns(prompts, n=n, max_tokens=max_tokens, tokenizer=self._llm.get_tokenizer())
            turns.begin()
            stop = turns.stop
        if not self._calls:
            self._begin(seed)
        base = call_seed(seed if seed is not None else 0, stream=self.engine.stream) if seeded_requests else None
        self._calls[tag] = _Call(dict(temperature=temperature, stop=tuple(stop), truncation=truncation),
                                 [[None] * n for _ in prompts],
                                 seed=base, turns=turns)
        if turns is None:
            for i, p in enumerate(prompts):
                self._ask(_Request(tag, i, None, list(p), budgets[i]), n)
        else:  # an episode's turns go at its own pace: its first is a request of its own too
            self._ask_turns(tag, turns.poll() if self.overlap_envs else turns.settle())

    def step(self) -> list[tuple[int, list[list[Completion]]]]:
        """One forward step of every request in flight; the calls it completed, with their completions
        (each cut from the captures as its request finishes)."""
        if self.engine.version != self._seen:  # a sync loaded since the last step: what was sampled was the old weights'
            for key, sampled in vllm_internals.progress(self._llm.llm_engine).items():
                self._marks.setdefault(key, []).append((sampled, self.engine.version))
            self._seen = self.engine.version
        waiting = next((c.turns for c in self._calls.values() if c.turns is not None), None)
        if not self._owner and waiting is not None:  # nothing to sample until an environment answers: wait, not spin
            waiting.wait()
        finished = [o for o in self._llm.llm_engine.step() if o.finished] if self._owner else []
        if finished:
            ids = [o.request_id for o in finished]
            routes = self._llm.collective_rpc(cpu_routes.take, args=(ids,))[0] if self._cpu_routes else {}
            logps, stamps, kept = self._llm.collective_rpc(cpu_logprobs.take, args=(ids,))[0] \
                if self.engine.capture_logprobs else ({}, {}, {})
        ended: dict[int, list] = {}  # call → the episodes' turns that ended in this step, (prompt, completion, turn, sample)
        for o in finished:
            req = self._owner.pop(o.request_id)
            call = self._calls[req.tag]
            call.waiting -= 1
            start = self._asked_at.pop(o.request_id)
            for c in o.outputs:
                slot = c.index if req.slot is None else req.slot
                marks = self._marks.pop((o.request_id, c.index), ())
                times = self._preempted.pop((o.request_id, c.index), 0)
                if times and self.engine.capture_routes:  # its routes were recomputed: asked again at once
                    self._redraw(req, slot)
                    continue
                got = self.engine.completion(req.prompt, o.request_id, c, logps, stamps, routes, kept)
                if got.versions is None:  # no CPU capture stamped them
                    got = dataclasses.replace(got, versions=self._versions(start, marks, len(c.token_ids)))
                got = dataclasses.replace(got, preempted=times, regenerated=call.redrawn.get((req.i, slot, req.turn), 0))
                if call.turns is None:
                    call.groups[req.i][slot] = got
                else:
                    ended.setdefault(req.tag, []).append((req.i, slot, req.turn, got))
        for tag, turns in ended.items():  # their calls sent to their environments, which answer on their own workers
            self._calls[tag].turns.took([(i, slot, c) for i, slot, _, c in turns])
        for tag, call in self._calls.items():  # each episode whose environment answered (or started): its next turn
            if call.turns is not None:
                self._ask_turns(tag, call.turns.poll() if self.overlap_envs else call.turns.settle())
        answered = [t for t, call in self._calls.items()
                    if not call.waiting and (call.turns is None or call.turns.finished)]
        done = [(tag, self._complete(tag)) for tag in answered]
        if not self._calls:
            self._end()
        return done

    def _redraw(self, req: _Request, slot: int) -> None:
        """A preempted R3 sample asked again, as a request of its own (its call waits for it)."""
        call, key = self._calls[req.tag], (req.i, slot, req.turn)
        call.redrawn[key] = call.redrawn.get(key, 0) + 1
        if call.redrawn[key] > self.max_redraws:
            raise RuntimeError(f"an R3 sample preempted {self.max_redraws + 1} times in a row: the engine's KV cache "
                               "cannot hold what it is asked to sample (rollout.kv_cache_gib, rollout.memory_fraction)")
        self._ask(dataclasses.replace(req, slot=slot), 1)

    def _complete(self, tag: int) -> list[list[Completion]]:
        """A call whose requests have all finished: its completions, [prompt][n] (its episodes'),
        its environments closed."""
        call = self._calls.pop(tag)
        if call.turns is None:
            return call.groups
        self._hosts.add(call.turns.host)
        try:
            return call.turns.completions()
        finally:
            call.turns.close()

    @staticmethod
    def _versions(start: int, marks, length: int) -> tuple[int, ...]:
        """Each of `length` tokens' version: `start`, then each sync's from the token it came before.

        >>> Stream._versions(3, [(2, 4), (2, 5), (4, 6)], 5)
        (3, 3, 5, 5, 6)
        """
        out = [start] * length
        for at, version in marks:
            out[at:] = [version] * (length - at)
        return tuple(out)

    def cancel(self, tags) -> list[int]:
        """Drop the calls `tags` still in flight (a rollback undid the weights they were asked for):
        their requests aborted, their captures taken and thrown away. Returns the tags dropped."""
        gone = [t for t in tags if t in self._calls]
        if not gone:
            return []
        rids = [rid for rid, req in self._owner.items() if req.tag in gone]
        self._llm.llm_engine.abort_request(rids)
        if self._cpu_routes:
            self._llm.collective_rpc(cpu_routes.take, args=(rids,))
        if self.engine.capture_logprobs:
            self._llm.collective_rpc(cpu_logprobs.take, args=(rids,))
        for rid in rids:
            self._owner.pop(rid, None)
            self._asked_at.pop(rid, None)
        self._marks = {k: v for k, v in self._marks.items() if k[0] not in rids}
        for key in [k for k in self._preempted if k[0] in rids]:  # in place: the preemption watch writes into it
            del self._preempted[key]
        for t in gone:
            _close(self._calls.pop(t))
        if not self._calls:
            self._end()
        return gone

    def fail(self) -> list[int]:
        """Drop every call in flight (an error in a step): their requests aborted, the captures
        discarded. Returns their tags."""
        tags = list(self._calls)
        with contextlib.suppress(Exception):
            self._llm.llm_engine.abort_request(list(self._owner))
        for call in self._calls.values():
            with contextlib.suppress(Exception):
                _close(call)
        self._calls.clear()
        self._owner.clear()
        self._asked_at.clear()
        self._marks.clear()
        for on, recorder in ((self._cpu_routes, cpu_routes), (self.engine.capture_logprobs, cpu_logprobs)):
            if on:
                with contextlib.suppress(Exception):
                    self._llm.collective_rpc(recorder.discard)
        self._open.close()
        return tags

    # ----------------------------------------------------------------------------------------------
    @property
    def _cpu_routes(self) -> bool:
        return self.engine.capture_routes and self.engine.on_cpu

    def _ask(self, req: _Request, n: int) -> None:
        """Ask for `req`: all n samples of a prompt (slot None), or one slot (a redraw, an episode's turn)."""
        call = self._calls[req.tag]
        redraws = call.redrawn.get((req.i, req.slot, req.turn), 0) if req.slot is not None else 0
        rid = f"{req.tag}.{req.i}" if req.slot is None else f"{req.tag}.{req.i}.{req.slot}.{redraws}"
        if req.turn:
            rid += f".t{req.turn}"
        self._owner[rid] = req
        self._asked_at[rid] = self.engine.version
        call.waiting += 1
        seed = None if call.seed is None else request_seed(call.seed, req.i, req.slot, redraws=redraws, turn=req.turn,
                                                           own=call.turns is not None)
        self._llm.llm_engine.add_request(rid, self.engine.prompt(req.prompt),
                                         self.engine.sampling(n=n, seed=seed, max_tokens=req.budget, **call.params))

    def _ask_turns(self, tag: int, asks) -> None:
        """Episodes' next turns, each a request of its own (its turn: how many it has taken)."""
        episodes = self._calls[tag].turns.episodes
        for i, j, (prompt, budget) in asks:
            self._ask(_Request(tag, i, j, prompt, budget, episodes[i][j].info["turns"]), 1)

    def _begin(self, seed: int | None) -> None:
        self.engine.wake()
        self._seen = self.engine.version
        # the process's generators seeded for the calls in flight, given back their state when none is
        # (an engine in the trainer's process: the trainer's draws are not disturbed)
        self._open.enter_context(seeded_sampling(seed, stream=self.engine.stream))
        if self._cpu_routes:
            self._llm.collective_rpc(cpu_routes.start)
        if self.engine.capture_logprobs:
            self._llm.collective_rpc(cpu_logprobs.start)
        self._preempted = self._open.enter_context(vllm_internals.preemptions(self._llm.llm_engine))

    def _end(self) -> None:
        # nothing in flight: the environments kept between episodes (a client's sessions) let go, so that
        # a server's sessions are free for the trainer's evaluation meanwhile
        while self._hosts:
            self._hosts.pop().let_go()
        self.engine.settle_prefix_cache()  # a reset vLLM refused while requests were in flight
        if self._cpu_routes:
            self._llm.collective_rpc(cpu_routes.stop)
        if self.engine.capture_logprobs:
            self._llm.collective_rpc(cpu_logprobs.stop)
        self._open.close()


def _close(call: _Call) -> None:
    """A call dropped before it was answered: its episodes' environments closed."""
    if call.turns is not None:
        call.turns.close()
