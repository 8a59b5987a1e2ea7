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
seed seeds the engine's generators when it comes to an idle engine: alone, a call repeats; beside
others, its noise depends on theirs (with in-flight updates a run does not repeat exactly anyway).

Runs in the engine's process (process.py), around the `VLLMEngine` of that process (vllm.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

from minirl.rollout import steps
from minirl.rollout.cpu import logprobs as cpu_logprobs
from minirl.rollout.cpu import routes as cpu_routes
from minirl.rollout.engine import Completion
from minirl.rollout.seeding import seed_generators


@dataclass
class _Call:
    prompts: list[list[int]]
    groups: list[list[Completion | None]]  # [prompt][completion], filled as requests finish
    left: int  # completions not yet kept
    params: dict  # temperature, max_tokens
    redrawn: dict[tuple[int, int], int] = field(default_factory=dict)  # (prompt, completion) → draws thrown away


class Stream:
    def __init__(self, engine, *, max_redraws: int):
        self.engine, self.max_redraws = engine, max_redraws
        self._llm = engine._llm
        self._calls: dict[int, _Call] = {}
        self._owner: dict[str, tuple[int, int, int | None]] = {}  # request id → (call, prompt, completion or all n)
        self._open = contextlib.ExitStack()  # while busy: the preemption watch
        self._preempted: dict[tuple[str, int], int] = {}

    @property
    def busy(self) -> bool:
        return bool(self._calls)

    def add(self, tag: int, prompts, *, n: int, temperature: float, max_tokens: int, seed: int | None = None) -> None:
        """Call `tag`'s n samples of each prompt, into the engine at once (between two forward steps)."""
        if not self._calls:
            self._begin(seed)
        call = _Call([list(p) for p in prompts], [[None] * n for _ in prompts], len(prompts) * n,
                     dict(temperature=temperature, max_tokens=max_tokens))
        self._calls[tag] = call
        for i in range(len(prompts)):
            self._ask(tag, i, None, n)

    def step(self) -> list[tuple[int, list[list[Completion]]]]:
        """One forward step of every request in flight; the calls it completed, with their completions."""
        finished = [o for o in self._llm.llm_engine.step() if o.finished]
        if not finished:
            return []
        ids = [o.request_id for o in finished]
        routes = self._llm.collective_rpc(cpu_routes.take, args=(ids,))[0] if self._cpu_routes else {}
        logps, stamps = self._llm.collective_rpc(cpu_logprobs.take, args=(ids,))[0] \
            if self.engine.capture_logprobs else ({}, {})
        done = []
        for o in finished:
            tag, i, j = self._owner.pop(o.request_id)
            call = self._calls[tag]
            for c in o.outputs:
                slot = c.index if j is None else j
                times = self._preempted.pop((o.request_id, c.index), 0)
                lost = bool(times) and self.engine.capture_routes
                got = self.engine.completion(call.prompts[i], o.request_id, c, logps, stamps, routes, preempted=lost)
                if lost:  # its routes were recomputed: asked again
                    call.redrawn[(i, slot)] = call.redrawn.get((i, slot), 0) + 1
                    if call.redrawn[(i, slot)] > self.max_redraws:
                        raise RuntimeError(f"an R3 sample preempted {self.max_redraws + 1} times in a row: the "
                                           "engine's KV cache cannot hold what it is asked to sample "
                                           "(rollout.kv_cache_gib, rollout.memory_fraction)")
                    self._ask(tag, i, slot, 1)
                    continue
                call.groups[i][slot] = dataclasses.replace(got, preempted=times,
                                                           regenerated=call.redrawn.get((i, slot), 0))
                call.left -= 1
            if not call.left:
                done.append((tag, self._calls.pop(tag).groups))
        if not self._calls:
            self._end()
        return done

    def fail(self) -> list[int]:
        """Drop every call in flight (an error in a step): their requests aborted, the captures
        discarded. Returns their tags."""
        tags = list(self._calls)
        with contextlib.suppress(Exception):
            self._llm.llm_engine.abort_request(list(self._owner))
        self._calls.clear()
        self._owner.clear()
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

    def _ask(self, tag: int, i: int, slot: int | None, n: int) -> None:
        """Request prompt i of call `tag`: all n samples (slot None), or one slot again."""
        call = self._calls[tag]
        rid = f"{tag}.{i}" if slot is None else f"{tag}.{i}.{slot}.{call.redrawn[(i, slot)]}"
        self._owner[rid] = (tag, i, slot)
        self._llm.llm_engine.add_request(rid, {"prompt_token_ids": call.prompts[i]},
                                         self.engine.sampling(n=n, **call.params))

    def _begin(self, seed: int | None) -> None:
        self.engine.wake()
        if seed is not None:
            seed_generators(seed, stream=self.engine.stream)
        if self._cpu_routes:
            self._llm.collective_rpc(cpu_routes.start)
        if self.engine.capture_logprobs:
            self._llm.collective_rpc(cpu_logprobs.start)
        self._preempted = self._open.enter_context(steps.preemptions(self._llm.llm_engine))

    def _end(self) -> None:
        if self._cpu_routes:
            self._llm.collective_rpc(cpu_routes.stop)
        if self.engine.capture_logprobs:
            self._llm.collective_rpc(cpu_logprobs.stop)
        self._open.close()
