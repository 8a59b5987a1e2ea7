"""The launcher: this process is the whole job, or one rank of a torchrun job.

It owns the process group and this rank's device. `World` is all the RL loop sees of the ranks:
its share of a batch, sums and means over ranks, and whether it is the rank that writes files.
A world of one is the same code with every operation an identity.

Under torchrun every rank runs the whole loop (SPMD): its own vLLM engine on its share of the
prompts (vLLM's `external_launcher` executor, one tensor-parallel group per rank), its shard of
the trainer (FSDP2 / expert parallel, `parallel.py`), and the collectives the two need. Rank 0
alone writes metrics, summaries, JSON beside checkpoints and exported folders; checkpoints
themselves are DCP, written by every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class World:
    size: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        """The rank that writes files and prints."""
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous slice of `items`: sizes differ by at most one, rank order kept,
        so `gather(share(x)) == x`."""
        n, extra = divmod(len(items), self.size)
        start = self.rank * n + min(self.rank, extra)
        return list(items[start : start + n + (self.rank < extra)])

    def gather(self, items: list[T]) -> list[T]:
        """Every rank's `items`, concatenated in rank order."""
        if self.size == 1:
            return list(items)
        import torch.distributed as dist

        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, list(items))
        return [x for part in parts for x in part]

    def mean(self, values: dict[str, Any], *, weight: float = 1.0, sums: Sequence[str] = ()) -> dict[str, Any]:
        """Each number's mean over ranks, weighted by `weight` (this rank's count of rows or tokens);
        keys ending in `_max` take the maximum, keys in `sums` the sum, lists of numbers are
        reduced element by element. Anything else (strings) is taken as it is: it is the same on
        every rank."""
        if self.size == 1:
            return dict(values)
        import torch.distributed as dist

        slots = [(k, i, float(x)) for k, v in values.items()  # (key, list index or None, value)
                 for i, x in ([(None, v)] if _is_number(v) else enumerate(v) if _numbers(v) else [])]
        x = torch.tensor([s[2] for s in slots], dtype=torch.float64)
        is_max = torch.tensor([k.endswith("_max") for k, _, _ in slots], dtype=torch.bool)
        is_sum = torch.tensor([k in sums for k, _, _ in slots], dtype=torch.bool)
        packed = torch.cat([torch.where(is_sum, x, x * weight), torch.tensor([float(weight)], dtype=torch.float64)])
        biggest = x.clone()
        dist.all_reduce(packed)
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
        total = torch.where(is_sum, packed[:-1], packed[:-1] / packed[-1])
        total = torch.where(is_max, biggest, total).tolist()
        out = {k: list(v) if isinstance(v, list) else v for k, v in values.items()}
        for (k, i, _), v in zip(slots, total):
            if i is None:
                out[k] = round(v) if isinstance(values[k], int) else v
            else:
                out[k][i] = v
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (a stop request, a time limit)."""
        if self.size == 1:
            return bool(flag)
        import torch.distributed as dist

        t = torch.tensor([int(bool(flag))])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (a run folder's name)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and all(map(_is_number, v))


def in_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start() -> World:
    """This process's World: under torchrun (WORLD_SIZE > 1) it joins the job's process group
    (gloo for CPU tensors, NCCL for CUDA ones) and takes the GPU of its LOCAL_RANK."""
    if not in_torchrun():
        return World(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # metrics and counts travel as CPU tensors, weights as CUDA ones
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return World(size=dist.get_world_size(), rank=dist.get_rank(), device=device)

