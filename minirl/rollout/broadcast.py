"""Weights from the trainer's rank to engine processes by broadcast (#66: rollout GPUs apart from
the trainer's, `parallel.rollout_gpus`), over a process group of their own: gloo on CPUs, NCCL
where the ranks hold GPUs. It is apart from torch.distributed's default group, which vLLM and
TorchTitan each set up inside their own processes, so neither sees it.

The trainer's rank (0) hosts the group's store on a port the OS picks (`host`; the engines
`join` it with that port: nothing picked first and bound later) and sends each sync either
- as one flat buffer (`send` / `receive`): an engine that keeps HF-named views between syncs (the
  CPU engine's direct path) receives into the same buffer every time and binds its views once; or
- bucket by bucket (`send_buckets` / `receive_buckets`), the trainer's sync buckets as they come
  (whole decoder layers, `rollout.sync_bucket_mib`): what either side holds at once is one
  bucket, not the model; each received bucket is a new buffer, which the engine's reload may keep.
The layout (names, shapes, dtypes) goes through the store once, at the first sync; later syncs
move numbers only. The group is built at the first sync, when every rank takes part.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16)}
WAIT = timedelta(hours=2)
Bucket = list[tuple[str, torch.Tensor]]


class WeightChannel:
    def __init__(self, store: dist.Store, rank: int, size: int, backend: str = "gloo", device: str = "cpu"):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: gloo or nccl")
        self.store, self.rank, self.size, self.backend = store, rank, size, backend
        self.device = torch.device(device)
        self._group = None  # built at the first sync (every rank joins it then)
        self._flat: torch.Tensor | None = None  # `send` / `receive`: one buffer, its views handed out once
        self._views: dict[str, torch.Tensor] | None = None
        self._layout: list[list[tuple[str, list[int], str]]] = []  # `*_buckets`: each bucket's names, shapes, dtype
        self._layout_known = False  # after the first bucketed sync

    @classmethod
    def host(cls, size: int, backend: str = "gloo", device: str = "cpu", timeout_s: float = 600.0) -> "WeightChannel":
        """Rank 0 (the trainer's): a store on a port the OS picks (`address`), for `size` ranks."""
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return cls(store, 0, size, backend, device)

    @classmethod
    def join(cls, host: str, port: int, rank: int, size: int, backend: str = "gloo", device: str = "cpu",
             timeout_s: float = 600.0) -> "WeightChannel":
        """An engine's rank (1 …): the store rank 0 hosts at `host`:`port`."""
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, size, backend, device)

    @property
    def address(self) -> tuple[str, int]:
        """Where the engines join: this host's name as the others reach it (one node: loopback)."""
        return "127.0.0.1", self.store.port

    # ----- one flat buffer, bound once ----------------------------------------------------------
    def send(self, named: dict[str, torch.Tensor]) -> None:
        """Rank 0: one sync of `named` (HF names → tensors) to every other rank."""
        if self._flat is None:
            manifest = [(n, list(t.shape), str(t.dtype)) for n, t in named.items()]
            self.store.set("minirl/weights", json.dumps(manifest))
            self._flat = torch.empty(sum(t.numel() for t in named.values()), dtype=next(iter(named.values())).dtype,
                                     device=self.device)
        torch.cat([t.detach().reshape(-1).to(self._flat.dtype) for t in named.values()], out=self._flat)
        self._broadcast(self._flat)

    def receive(self) -> dict[str, torch.Tensor]:
        """An engine rank: one sync, into the same tensors every time (views of one flat buffer)."""
        if self._views is None:
            manifest = json.loads(self.store.get("minirl/weights"))
            self._flat = torch.empty(sum(_numel(shape) for _, shape, _ in manifest), dtype=_DTYPES[manifest[0][2]],
                                     device=self.device)
            self._views = _views(self._flat, manifest)
        self._broadcast(self._flat)
        return self._views

    # ----- bucket by bucket ---------------------------------------------------------------------
    def send_buckets(self, buckets: Iterable[Bucket]) -> None:
        """Rank 0: one sync, a bucket at a time as `buckets` yields them (the same layout every sync)."""
        first, n = not self._layout_known, 0
        for n, bucket in enumerate(buckets, start=1):
            layout = [(name, list(t.shape), str(t.dtype)) for name, t in bucket]
            if len({d for _, _, d in layout}) != 1:
                raise ValueError(f"a weight bucket mixes dtypes ({sorted({d for _, _, d in layout})}): cast it to the engine's")
            if first:  # the receivers read each bucket's layout just before its numbers
                self.store.set(f"minirl/bucket/{n - 1}", json.dumps(layout))
                self._layout.append(layout)
            elif n > len(self._layout) or layout != self._layout[n - 1]:
                raise RuntimeError(f"weight bucket {n - 1} changed between syncs: the sync's layout is fixed at the first")
            self._broadcast(torch.cat([t.detach().reshape(-1).to(self.device) for _, t in bucket]))
        if first:
            self.store.set(f"minirl/bucket/{n}", "end")
            self._layout_known = True
        elif n != len(self._layout):
            raise RuntimeError(f"a sync of {n} weight buckets; the first had {len(self._layout)}")

    def receive_buckets(self) -> Iterator[Bucket]:
        """An engine rank: one sync's buckets, each a new buffer, as they arrive (consume them all)."""
        i = 0
        while True:
            if not self._layout_known and i == len(self._layout):  # the first sync: the layout as it comes
                got = self.store.get(f"minirl/bucket/{i}").decode()
                if got == "end":
                    self._layout_known = True
                    return
                self._layout.append(json.loads(got))
            elif i == len(self._layout):
                return
            layout = self._layout[i]
            flat = torch.empty(sum(_numel(shape) for _, shape, _ in layout), dtype=_DTYPES[layout[0][2]],
                               device=self.device)
            self._broadcast(flat)
            yield list(_views(flat, layout).items())
            i += 1

    def _broadcast(self, flat: torch.Tensor) -> None:
        if self._group is None:
            self._group = _group(self.store, self.rank, self.size, self.backend, self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([flat], opts).wait()


def _group(store: dist.Store, rank: int, size: int, backend: str, device: torch.device):
    """A process group of `size` ranks on `store`, outside torch.distributed's default group. Its
    collectives wait up to WAIT: an engine takes a sync after the batches sent before it, and a
    batch of long responses takes longer than the groups' defaults (gloo 30 min, NCCL 10)."""
    store = dist.PrefixStore("minirl/group", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, WAIT)
    # NCCL: never run here (no GPU on the machine that built it; docs/verification.md)
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = WAIT
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _views(flat: torch.Tensor, manifest) -> dict[str, torch.Tensor]:
    views, at = {}, 0
    for name, shape, _ in manifest:
        views[name] = flat[at:at + _numel(shape)].view(shape)
        at += _numel(shape)
    return views


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
