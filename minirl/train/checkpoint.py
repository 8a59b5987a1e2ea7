"""Trainer checkpoints: torch.distributed.checkpoint (DCP) folders, the format TorchTitan itself
writes, with model and optimizer state, loadable under any later parallel layout; each written
aside and renamed into place, and a failed write explained (a full disk, a read-only folder).
`main`: the rank that handles the folder and the JSON (every rank writes its own shards)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from minirl.disk import atomic, store
from minirl.disk.oserrors import os_error_of
from minirl.errors import UsageError
from minirl.train.lora import is_adapter


def save(model, optim, path: Path, extra: dict | None, *, sharded: bool, main: bool,
         adapters_only: bool = False) -> Path:
    """DCP checkpoint of model + optimizer, plus `extra` (step, sampler, ...) as JSON. Atomic:
    written to a temp folder and renamed, so a crash mid-save never leaves a half checkpoint.

    adapters_only: of the model, the LoRA adapters alone (the frozen base is the model folder that
    `extra["base"]` names); `load` then reads them into a trainer that holds that base.

    An optimizer that has not stepped yet is not saved: DCP would first materialise its state
    with a zero step, which advances Adam's step count and changes every later update."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if main and tmp.exists():
        shutil.rmtree(tmp)
    _barrier(sharded)
    has_optim = bool(optim.state)
    own = get_model_state_dict(model)
    state = {"model": _adapters_of(own) if adapters_only else own}
    if has_optim:
        state["optim"] = get_optimizer_state_dict(model, optim)
    needed = _nbytes(state)
    try:
        _check_room(path.parent, needed)  # a full disk fails before a byte is written
        # a collective under torchrun: every rank's shards are written after it. One process
        # stays off collectives (`no_dist`): vLLM's in-process engine starts a one-rank gloo
        # group, and a DCP save through it left every later update slower
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not sharded)
        # the record last (minirl/disk/store.py): a folder without it was never finished
        if main:
            name, text = store.record_text({**(extra or {}), "has_optim": has_optim})
            atomic.write_text(tmp / name, text)
    except BaseException as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs back
        cause = os_error_of(e)
        if cause is None and not isinstance(e, KeyboardInterrupt):
            cause = _why_write_failed(path.parent, needed)
        if cause is not None:
            raise cause from None
        raise
    if main and path.exists():  # the same step saved twice (a final save right after a periodic one): same state
        shutil.rmtree(tmp, ignore_errors=True)
    elif main:
        os.replace(tmp, path)
    _barrier(sharded)  # no rank reads the checkpoint before it is in place
    return path

def _barrier(sharded: bool) -> None:
    if sharded:
        dist.barrier()


def read_extra(path: Path) -> dict:
    """A checkpoint's record (step, sampler, ...; a LoRA checkpoint's settings and base)."""
    return store.read_record(path)


def load(model, optim, path: Path, *, with_optim: bool, sharded: bool) -> dict:
    """Restore a checkpoint; one saved before the first optimizer step restores a fresh optimizer."""
    extra = read_extra(path)
    load_optim = with_optim and extra.get("has_optim", True)
    own = get_model_state_dict(model)
    _check_adapters(path, own)
    state = {"model": _adapters_of(own) if extra.get("lora") else own}
    if load_optim:
        state["optim"] = get_optimizer_state_dict(model, optim)
    dcp.load(state, checkpoint_id=str(path), no_dist=not sharded)  # see `save`
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not extra.get("lora")))
    if load_optim:
        set_optimizer_state_dict(model, optim, state["optim"])
    elif with_optim:
        optim.state.clear()
    return extra


def _adapters_of(state: dict) -> dict:
    """The LoRA adapters' entries of a state dict (of tensors or of their shapes)."""
    return {k: v for k, v in state.items() if is_adapter(k)}


def _check_adapters(path: Path, model_state: dict) -> None:
    """A checkpoint's LoRA adapters (train/lora.py) and the trainer's must be the same: DCP would
    otherwise load the base alone into a trainer without them, silently, or fail on a rank's shapes."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    theirs = _adapters_of({k.removeprefix("model."): tuple(getattr(m, "size", ())) for k, m in meta.items()
                        if k.startswith("model.")})
    mine = _adapters_of({k: tuple(v.shape) for k, v in model_state.items()})
    if theirs == mine:
        return
    if not mine:
        raise UsageError(f"{path} holds LoRA adapters and this trainer has none: load it with the [train.lora] of "
                         "the run that saved it (its recipe.toml)")
    if not theirs:
        raise UsageError(f"{path} is a checkpoint of every weight (no LoRA adapters) and this trainer trains adapters: "
                         "set train.lora.rank = 0 to resume it, or start LoRA from its exported HF folder")
    raise UsageError(f"{path} holds LoRA adapters of another rank or on other weights than this trainer's "
                     "[train.lora]: resume it with the settings it was saved with")


def _nbytes(state) -> int:
    """Bytes of all tensors in a (nested) state dict: what a checkpoint of it needs on disk."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def _check_room(folder: Path, needed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"No space left on device ({free / 2**20:.1f} MiB free, a checkpoint needs "
                                    f"{needed / 2**20:.1f} MiB)", str(folder))


def _why_write_failed(folder: Path, needed: int) -> OSError | None:
    """torch's writer reports a short write as "unexpected pos vs ..." and drops the errno: look
    for the cause ourselves (a full disk, a folder that stopped being writable)."""
    try:
        _check_room(folder, needed)
        probe = folder / ".minirl-write-probe"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        return e
    return None
