"""The optimizer's state off the accelerator while the rollout engine has it (train.offload =
"optimizer"): Adam's two moments are 8 of the 16 bytes a trained parameter costs, and between one
update and the next nothing reads them. `to_host` copies each into (pinned) host memory and drops
the device's copy; `to_device` brings them back before the next optimizer step. The copies are
exact, so an update after a round trip is the update without one.

Tensors are moved, never viewed: on a CPU trainer (no accelerator) `to_host` still makes a fresh
host copy and drops the old one, so the CPU tests exercise the same round trip a GPU makes.
Sharded moments (FSDP2's DTensors) move their local shard and keep their placement.
"""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _moved(t: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """`t` copied onto `device` (its shard, for a DTensor, rewrapped with the same placement)."""
    from torch.distributed.tensor import DTensor

    local = _local(t)
    out = torch.empty(local.shape, dtype=local.dtype, device=device, pin_memory=pin)
    out.copy_(local, non_blocking=True)
    if isinstance(t, DTensor):
        return DTensor.from_local(out, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return out


def _moments(optim: torch.optim.Optimizer):
    """(state dict, key, parameter) of every tensor state but Adam's step counter."""
    for group in optim.param_groups:
        for p in group["params"]:
            for key, value in optim.state.get(p, {}).items():
                if key != "step" and isinstance(value, torch.Tensor):
                    yield optim.state[p], key, p


def to_host(optim: torch.optim.Optimizer, host: torch.device | str = "cpu") -> int:
    """Every moment that sits beside its parameter goes to `host` (pinned when the parameters are
    on CUDA: the copies run at the link's full rate); returns the bytes moved."""
    host, moved, cuda = torch.device(host), 0, False
    for state, key, p in _moments(optim):
        if _local(state[key]).device == _local(p).device:
            cuda = cuda or _local(p).device.type == "cuda"
            state[key] = _moved(state[key], host, pin=_local(p).device.type == "cuda")
            moved += _local(state[key]).nbytes
    if cuda:
        torch.cuda.synchronize()  # the device copies are released only once the host holds them
    return moved


def to_device(optim: torch.optim.Optimizer) -> int:
    """Every moment back beside its parameter (before an optimizer step); returns the bytes moved."""
    moved = 0
    for state, key, p in _moments(optim):
        device = _local(p).device
        if _local(state[key]).device != device:
            state[key] = _moved(state[key], device, pin=False)
            moved += _local(state[key]).nbytes
    return moved

