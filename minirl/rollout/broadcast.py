"""Weights from the trainer's rank to engine ranks by broadcast (#66: rollout ranks beside training
ranks), over a process group of their own: gloo here, NCCL where the ranks hold GPUs. It is apart
from torch.distributed's default group, which vLLM and TorchTitan each set up inside their own
processes, so neither sees it.

The trainer's rank (0) publishes the weights' names, shapes and dtypes once in the group's store
and then broadcasts every sync as one flat buffer; an engine rank receives straight into one flat
buffer whose views, under the same names, its engine binds once (`VLLMEngine.load_live_weights`):
nothing renamed, allocated or copied twice per sync. Not yet wired into `minirl run` (the launcher
that places training and rollout ranks is the next piece); tests/test_async.py moves the weights
between two processes with it and checks the engine's scores against the trainer's.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16)}


class WeightChannel:
    def __init__(self, store: dist.Store, rank: int, size: int, backend: str = "gloo"):
        if backend != "gloo":
            raise NotImplementedError(f"backend {backend!r}: NCCL between rollout and training GPUs is not built yet")
        self.store, self.rank, self.size = store, rank, size
        self.group = dist.ProcessGroupGloo(store, rank, size)
        self._flat: torch.Tensor | None = None  # an engine rank's buffer, its views handed out once
        self._views: dict[str, torch.Tensor] | None = None

    @classmethod
    def join(cls, host: str, port: int, rank: int, size: int, timeout_s: float = 300.0) -> "WeightChannel":
        """Rank 0 (the trainer's) hosts the store; every rank waits for all `size` to join."""
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, size)

    def send(self, named: dict[str, torch.Tensor]) -> None:
        """Rank 0: one sync of `named` (HF names → tensors) to every other rank."""
        if self._flat is None:
            manifest = [(n, list(t.shape), str(t.dtype)) for n, t in named.items()]
            self.store.set("minirl/weights", json.dumps(manifest))
            self._flat = torch.empty(sum(t.numel() for t in named.values()), dtype=next(iter(named.values())).dtype)
        torch.cat([t.detach().reshape(-1).to(self._flat.dtype) for t in named.values()], out=self._flat)
        self._broadcast(self._flat)

    def receive(self) -> dict[str, torch.Tensor]:
        """An engine rank: one sync, into the same tensors every time (views of one flat buffer)."""
        if self._views is None:
            manifest = json.loads(self.store.get("minirl/weights"))
            dtype = _DTYPES[manifest[0][2]]
            self._flat = torch.empty(sum(_numel(shape) for _, shape, _ in manifest), dtype=dtype)
            views, at = {}, 0
            for name, shape, _ in manifest:
                views[name] = self._flat[at:at + _numel(shape)].view(shape)
                at += _numel(shape)
            self._views = views
        self._broadcast(self._flat)
        return self._views

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([flat], opts).wait()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
