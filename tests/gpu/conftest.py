"""GPU checks (`pytest -m gpu tests/gpu`; on a GPU machine: `bash tests/gpu/run-on-device.sh`).

Each test skips itself, with the reason, where no CUDA device is present (the `device` fixture);
`MINIRL_GPU_DRY=1` runs them on the CPU with the tiny model instead (kit.py). With
`MINIRL_GPU_REPORT=DIR` every test's outcome goes to DIR/outcomes.jsonl for the report.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

with contextlib.suppress(ImportError):
    # the device image's torch 2.11 lacks a class TorchTitan 0.3 imports; run-on-device.sh puts
    # ../shared/tools/gpu's stand-in on the path there, and only there
    import torch211_shim  # noqa: F401

from tests.gpu import kit  # noqa: E402


@pytest.fixture
def device():
    import torch

    if not kit.DRY and not torch.cuda.is_available():
        pytest.skip(kit.NO_GPU)
    return kit.device()


@pytest.fixture(params=["tiny", "moe"])
def shape(request):
    if kit.DRY and request.param != "tiny":
        pytest.skip("dry mode: the tiny model only")
    return kit.shapes()[request.param]


@pytest.fixture
def one_rank_group(device):
    """A process group of this one process, so the trainer can take the cluster's FSDP2 path
    (`Trainer(shard=True)`) at world size 1. After `device`, so that without a GPU the test skips
    before any group exists; left in place for the rest of the session (tests/gpu run in a process
    of their own: run-on-device.sh)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)


def pytest_runtest_logreport(report):
    if not kit.REPORT or (report.when != "call" and not (report.when == "setup" and report.outcome != "passed")):
        return
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    elif report.failed:  # the traceback's last line
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else (report.longreprtext or "").strip().splitlines()[-1:]
    Path(kit.REPORT).mkdir(parents=True, exist_ok=True)
    with open(Path(kit.REPORT) / "outcomes.jsonl", "a") as f:
        f.write(json.dumps({"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2),
                            "reason": reason}) + "\n")
