"""Rollout engines on GPUs of their own (`parallel.rollout_gpus`; #66): on each node the training
ranks train, and its rollout GPUs run one engine process each (on a CPU, the last of the first
rank's cores: the same code, "GPUs" being processes there).

Each node's first training rank starts its node's engines (process.py, one `EngineProcess` each)
and is the only rank that talks to them: a call's prompts (the node's share of a batch) are split
over the engines by demand (`shares`: each prompt's G samples to the engine with the fewest
sequences not yet answered, so with in-flight updates an engine still busy with long responses of
an earlier batch gets fewer of the next (one call at a time, a sync has drained every engine
first); equal loads give equal contiguous parts, as a static split would), their
answers joined in order, and given to the node's
training ranks: a step's batch each rank's share of it (scattered), an evaluation's or a parity
check's the whole (each keeps its part). A node's training ranks thus form one rollout group,
asking for the same prompts (`World.group_share`), as a tensor-parallel group does beside the
trainer; here `world` is the node's (`World.part`). Weights move by broadcast from that first rank
to its engines, within the node (broadcast.py: NCCL between GPUs, gloo on CPUs): every training
rank walks the sync's buckets (gathering FSDP / expert shards is a collective of the whole job, so
every first rank has them whole), and the first ranks send them; an engine receives when it gets
to the sync, and loads it.

A sync waits until every engine has taken it. Without `rollout.inflight_updates` an engine takes it
after the batches sent before it, so at k ≥ 2 the trainer waits for the older batches too (k = 1
loses nothing: the next step needs the batch sampled before the sync anyway); with it, between two
forward steps. Answers are read while a sync is under way, so neither side waits on the other's pipe.

An engine is one process on one GPU (rollout.tensor_parallel = 1): vLLM's tensor-parallel
workers are processes of their own, each of which would have to join the broadcast (refused in
setup/limits.py).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from minirl.rollout.broadcast import WeightChannel
from minirl.rollout.process import EngineProcess, split_cores


def placements(engines: int, tp: int, training_ranks: int, cores: set[int], cuda: bool) -> tuple[list[int], list[dict]]:
    """(the trainer's cores, each engine's `cores` and `gpus`): on CUDA an engine's GPUs are the node's
    after the training ranks' (its visible devices, in order); its cores, the starting rank's second half split
    among the engines (shared where there are fewer cores than engines).

    >>> placements(2, 1, 6, {0, 1, 2, 3, 4, 5, 6, 7}, cuda=False)
    ([0, 1, 2, 3], [{'cores': [4, 5], 'gpus': None}, {'cores': [6, 7], 'gpus': None}])
    >>> placements(2, 1, 6, {0, 1}, cuda=True)[1]
    [{'cores': [1], 'gpus': ['6']}, {'cores': [1], 'gpus': ['7']}]
    """
    mine, theirs = split_cores(cores)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(training_ranks + engines * tp)]
    out = []
    for e in range(engines):
        share = theirs[e * len(theirs) // engines:(e + 1) * len(theirs) // engines] or [theirs[e % len(theirs)]]
        gpus = devices[training_ranks + e * tp:training_ranks + (e + 1) * tp] if cuda else None
        out.append({"cores": share, "gpus": gpus})
    return mine, out


def shares(prompts: int, per_prompt: int, outstanding: list[int]) -> list[int]:
    """Prompts for each engine: one at a time to the engine with the fewest sequences outstanding
    (ties: the later engine, so equal loads split as `i * n // parts` does), each adding its
    `per_prompt` samples to that engine's load. The counts are all that matter (a call's prompts
    are alike to the dispatcher), so each engine's are one contiguous part, one call.

    >>> shares(3, 2, [0, 0]), shares(8, 2, [0, 8]), shares(4, 1, [0, 0, 0])
    ([1, 2], [6, 2], [1, 1, 2])
    """
    load, counts = list(outstanding), [0] * len(outstanding)
    for _ in range(prompts):
        e = min(range(len(load)), key=lambda i: (load[i], -i))
        counts[e] += 1
        load[e] += per_prompt
    return counts


class RemoteEngines:
    """A node's engines on its rollout GPUs behind the engine's contract (engine.py), held by each
    of its training ranks; the first rank's calls reach the engines, every rank of the node gets
    the answers (or its share)."""

    def __init__(self, model_dir: Path, rollout, *, world, engines: int, first_stream: int = 0, **kw: Any):
        """`world`: the node's training ranks; `engines`: the node's; `first_stream`: its first
        engine's stream of call seeds (each engine of the job has its own)."""
        self._world = world
        self.ranks = world.size
        self._engines: list[EngineProcess] = []
        self._asked: list[list[tuple[list, int]]] = []  # each engine's generate calls not yet answered: (handle, sequences)
        self._channel: WeightChannel | None = None
        info = None
        if world.main:
            cuda = world.device.type == "cuda"
            self._channel = WeightChannel.host(engines + 1, backend="nccl" if cuda else "gloo", device=str(world.device))
            host, port = self._channel.address
            mine, places = placements(engines, rollout.tensor_parallel, world.size, os.sched_getaffinity(0), cuda)
            backend = self._channel.backend
            self._engines = [EngineProcess(model_dir, rollout, wait=False, cores=p["cores"], gpus=p["gpus"],
                                           stream=first_stream + e, channel=(host, port, e + 1, engines + 1, backend),
                                           **kw)
                             for e, p in enumerate(places)]
            for e in self._engines:  # built side by side; answered in order
                e.ready()
            self._asked = [[] for _ in self._engines]
            os.sched_setaffinity(0, mine)
            torch.set_num_threads(len(mine))
            first = self._engines[0]
            info = {"torch_dtype": first.torch_dtype, "emulate_fp8": first.emulate_fp8,
                    "weight_format": first.weight_format, "direct_sync": first.direct_sync}
        info = world.broadcast(info)
        self.torch_dtype, self.emulate_fp8 = info["torch_dtype"], info["emulate_fp8"]
        self.weight_format, self.direct_sync = info["weight_format"], info["direct_sync"]

    @property
    def waited_s(self) -> float:
        """Seconds this rank spent blocked on its node's engines (its first rank's; 0 elsewhere)."""
        return sum(e.waited_s for e in self._engines)

    @property
    def busy_s(self) -> float:
        """The node's engines' mean seconds in calls answered so far (its first rank's; 0 elsewhere)."""
        return sum(e.busy_s for e in self._engines) / len(self._engines) if self._engines else 0.0

    # ----- calls --------------------------------------------------------------------------------
    def submit(self, method: str, *args, **kwargs) -> Any:
        """Send a call to the engines and return at once (the node's first rank; None elsewhere):
        `generate` and `score` split their lists over the engines (a generate's by demand: `shares`),
        anything else goes to each."""
        if not self._world.main:
            return None
        if method not in ("generate", "score"):
            return ("each", [e.submit(method, *args, **kwargs) for e in self._engines])
        sampled = method == "generate"  # a score's pairs are one sequence each, and nothing is outstanding for it
        per_prompt = kwargs.get("n", 1) if sampled else 1
        counts = shares(len(args[0]), per_prompt, self._outstanding() if sampled else [0] * len(self._engines))
        handles, lo = [], 0
        for i, (e, c) in enumerate(zip(self._engines, counts)):
            if c:
                part = {**kwargs, "episodes": kwargs["episodes"].part(lo, lo + c)} if kwargs.get("episodes") else kwargs
                h = e.submit(method, *(a[lo:lo + c] for a in args), **part)
                handles.append((e, h))
                if sampled:
                    self._asked[i].append((h, c * per_prompt))
            lo += c
        return ("split", handles)

    def _outstanding(self) -> list[int]:
        """Each engine's sampled sequences asked and not yet answered (the answers that came taken first)."""
        for e, asked in zip(self._engines, self._asked):
            e.drain(0.0)
            asked[:] = [(h, n) for h, n in asked if not h]
        return [sum(n for _, n in asked) for asked in self._asked]

    def cancel(self, handles: list) -> int:
        """A rollback's (rollout/__init__.py `discard`): drop these calls' parts, queued or under way,
        on every engine; how many of the calls were not yet answered whole."""
        dropped = 0
        for handle in handles:
            if handle is not None and handle[0] == "split":  # None: a rank that asks nothing itself
                dropped += sum([e.cancel([h]) for e, h in handle[1]]) > 0
        return dropped

    def result(self, handle: Any, *, share: bool = False) -> Any:
        """Every rank of the node: the call's answer (a split call's parts joined in order); with
        `share`, this rank's share of it alone (`World.share`: a step's batch, R3 routes and all,
        is not sent whole to every rank)."""
        out = None
        if self._world.main:
            how, handles = handle
            if how == "split":
                out = [x for e, h in handles for x in e.result(h)]
            else:
                out = [e.result(h) for e, h in zip(self._engines, handles, strict=True)][0]
        return self._world.scatter(out) if share else self._world.broadcast(out)

    def call(self, method: str, *args, **kwargs):
        return self.result(self.submit(method, *args, **kwargs))

    def generate(self, prompts, **kwargs):
        return self.call("generate", prompts, **kwargs)

    def score(self, prompts, responses):
        return self.call("score", prompts, responses)

    def set_version(self, version: int) -> None:
        self.call("set_version", version)

    def settle(self) -> None:
        """Return once every call sent has been answered (the first rank; the others have nothing under way)."""
        for e in self._engines:
            e.settle()

    def sleep(self) -> None:  # alone on their GPUs: nothing to free for the trainer
        pass

    def wake(self) -> None:
        pass

    def queue_weights(self, views, slots: int, version: int) -> bool:  # no shared memory across GPUs
        return False

    # ----- weights ------------------------------------------------------------------------------
    def send_weights(self, version: int, *, views: dict[str, torch.Tensor] | None = None, buckets=None) -> None:
        """One sync from every training rank (a collective where the trainer is sharded): `views`,
        the trainer's HF-named tensors, as one buffer an engine binds once; or `buckets`, the sync's
        bucket stream, which every rank walks to its end (each node's first rank sends it to its
        engines). Returns once every engine of the node has taken it; the engines' answers that
        come meanwhile are kept for their callers."""
        if not self._world.main:
            for _ in buckets if buckets is not None else ():
                pass
            return
        for e in self._engines:
            e.submit("receive_weights", version, views is not None)
        failed: list[BaseException] = []

        def send() -> None:
            try:
                if self._world.device.type == "cuda":  # the current device is a thread's own
                    torch.cuda.set_device(self._world.device)
                if views is not None:
                    self._channel.send(views)
                else:
                    self._channel.send_buckets(buckets)
            except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
                failed.append(err)

        sender = threading.Thread(target=send, name="minirl-weights", daemon=True)
        sender.start()
        while sender.is_alive():  # an engine may answer a batch before it gets to the sync
            for e in self._engines:
                e.drain(timeout_s=0.01)
            sender.join(timeout=0.0)
        if failed:
            raise failed[0]

    def close(self) -> None:
        for e in self._engines:
            e.close()
