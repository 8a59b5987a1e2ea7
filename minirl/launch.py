"""The launcher: this process is the whole job, or one rank of a torchrun job.

It owns the process group and this rank's device. `World` is all the RL loop sees of the ranks:
its share of a batch, sums and means over ranks, and whether it is the rank that writes files.
A world of one is the same code with every operation an identity.

Under torchrun every rank runs the whole loop (SPMD): a vLLM engine (vLLM's `external_launcher`
executor) shared with the other ranks of its tensor-parallel group, which all send it their
group's share of the prompts (`group_share`) and then keep their own part (`member_share`) (with
rollout GPUs of their own, no engine: rank 0 asks theirs for every rank, rollout/remote.py); its shard of
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

from minirl.errors import UsageError

T = TypeVar("T")


@dataclass
class World:
    size: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None  # the process group of a `part` of the job's ranks; None: the whole job's

    def part(self, size: int) -> "World":
        """The block of `size` consecutive ranks this rank is in (a node's ranks under torchrun), as
        a World of its own: its collectives among them alone. A collective: every rank calls it."""
        if size == self.size:
            return self
        import torch.distributed as dist

        mine = None
        for start in range(0, self.size, size):  # every block's group, built by every rank in one order
            g = dist.new_group(list(range(start, start + size))) if size > 1 else None
            if start <= self.rank < start + size:
                mine = g
        return World(size=size, rank=self.rank % size, device=self.device, group=mine)

    @property
    def main(self) -> bool:
        """The rank that writes files and prints."""
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous slice of `items`: sizes differ by at most one, rank order kept,
        so `gather(share(x)) == x`."""
        return _part(items, self.size, self.rank)

    def group_share(self, items: Sequence[T], tp: int) -> list[T]:
        """The slice of `items` for this rank's rollout group: ranks r // tp share one
        tensor-parallel vLLM engine and must send it the same requests."""
        return _part(items, self.size // tp, self.rank // tp)

    def member_share(self, group_items: Sequence[T], tp: int) -> list[T]:
        """This rank's part of its rollout group's items (what it trains on). With len(items) a
        multiple of the world size, `member_share(group_share(x, tp), tp) == share(x)`."""
        return _part(group_items, tp, self.rank % tp)

    def gather(self, items: list[T]) -> list[T]:
        """Every rank's `items`, concatenated in rank order."""
        if self.size == 1:
            return list(items)
        import torch.distributed as dist

        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, list(items), group=self.group)
        return [x for part in parts for x in part]

    def total(self, values: dict[str, float]) -> dict[str, float]:
        """Each number summed over ranks."""
        return self.mean(values, sums=tuple(values))

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
        dist.all_reduce(packed, group=self.group)
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=self.group)
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
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (a run folder's name; a part's first rank's, to its ranks)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def scatter(self, items: list[T] | None) -> list[T]:
        """This rank's share (`share`) of rank 0's `items` (None elsewhere): each rank receives only its own."""
        if self.size == 1:
            return list(items)
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, [_part(items, self.size, r) for r in range(self.size)] if self.main else None,
                                 group=self.group, group_src=0)
        return box[0]


def _part(items: Sequence[T], parts: int, index: int) -> list[T]:
    """Part `index` of `parts` contiguous slices whose sizes differ by at most one."""
    n, extra = divmod(len(items), parts)
    start = index * n + min(index, extra)
    return list(items[start : start + n + (index < extra)])


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
        dist.init_process_group(backend, **_fresh_store_after_restart())
    return World(size=dist.get_world_size(), rank=dist.get_rank(), device=device)


def _fresh_store_after_restart() -> dict:
    """After `torchrun --max-restarts` restarted the job, a rendezvous store that outlives the
    attempt (the static backend, or c10d sharing its store: TORCHELASTIC_USE_AGENT_STORE) still
    holds the failed attempt's addresses, and gloo or NCCL then connect to ranks that are gone
    (measured here: "Gloo connectFullMesh failed ... Connection refused" on every restart;
    pytorch/pytorch#135712). On one node the restart count is the same for every rank, so this
    attempt's keys go under their own prefix. Across nodes it is not (an agent that restarts for a
    peer's failure does not count it), so there the launch must give each attempt a fresh store:
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` with `--rdzv-backend c10d` (the launch commands do)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise UsageError("restarted across nodes with a shared rendezvous store: launch with "
                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and torchrun --rdzv-backend c10d (docs/cluster.md: Running on a "
                         "cluster)")
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"minirl/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}

