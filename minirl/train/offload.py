"""The optimizer's state off the accelerator while the rollout engine has it (train.offload =
"optimizer"): Adam's two moments are 8 of the 16 bytes a trained parameter costs, and between one
update and the next nothing reads them. `to_host` copies each into (pinned) host memory and drops
the device's copy; `to_device` brings them back before the next optimizer step. The copies are
exact, so an update after a round trip is the update without one.

Tensors are moved, never viewed: on a CPU trainer (no accelerator) `to_host` still makes a fresh
host copy and drops the old one, so the CPU tests exercise the same round trip a GPU makes.
Sharded moments (FSDP2's DTensors) move their local shard and keep their placement (as verl's
FSDP workers move theirs: `DTensor.to`).
"""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `t` on `device`, always a fresh one (copy=True: on one device too). From CUDA to
    the host the copy lands in pinned memory (PyTorch pins a non-blocking device-to-host copy's
    output). A DTensor's copy is its shard's, with the same mesh and placement; not
    `DTensor.from_local`, which would move a host shard straight back to the mesh's device."""
    return t.to(device, non_blocking=True, copy=True)


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
            state[key] = _moved(state[key], host)
            moved += _local(state[key]).nbytes
    if cuda:
        torch.cuda.synchronize()  # the host copies complete before the device blocks are handed back
    return moved


def to_device(optim: torch.optim.Optimizer) -> int:
    """Every moment back beside its parameter (before an optimizer step); returns the bytes moved."""
    moved = 0
    for state, key, p in _moments(optim):
        device = _local(p).device
        if _local(state[key]).device != device:
            state[key] = _moved(state[key], device)
            moved += _local(state[key]).nbytes
    return moved

