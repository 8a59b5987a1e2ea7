"""Both installs are pinned (.ci/constraints-{cpu,gpu}.txt) and cannot drift from pyproject.toml or
the Containerfile (.ci/lockcheck.py): every direct requirement pinned within its range, one
version a package, torch's companions from torch's release, one CUDA major, and the image's CUDA
that major. Planted mismatches show that each check can fail."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))

import lockcheck  # noqa: E402

PYPROJECT = (ROOT / "pyproject.toml").read_text()
GPU = (ROOT / ".ci/constraints-gpu.txt").read_text()
CPU = (ROOT / ".ci/constraints-cpu.txt").read_text()
CONTAINERFILE = (ROOT / "Containerfile").read_text()


def gpu_problems(lock=GPU, pyproject=PYPROJECT, containerfile=CONTAINERFILE):
    return lockcheck.problems(lock, pyproject, extras=("gpu", "test", "tasks", "envs"),
                              containerfile_text=containerfile)


def test_both_locks_agree_with_pyproject_and_the_image():
    assert lockcheck.problems(CPU, PYPROJECT, extras=("cpu", "test", "tasks", "envs")) == []
    assert gpu_problems() == []
    pins, _ = lockcheck.pins(GPU)
    assert (str(pins["torch"]), str(pins["vllm"]), str(pins["torchvision"])) == ("2.13.0", "0.32.0", "0.28.0")
    assert "torchaudio" not in pins and "torchcodec" not in pins  # left out (docs/cluster.md)
    assert lockcheck.removed_after_install(GPU) == {"torchaudio", "torchcodec"}


def swap(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


@pytest.mark.parametrize("plant, expected", [
    (lambda: gpu_problems(lock=swap(GPU, "torchvision==0.28.0", "torchvision==0.27.0")),
     "torchvision==0.27.0 is not torch 2.13's release (0.28)"),
    (lambda: gpu_problems(lock=GPU + "torch==2.12.0\n"), "torch is pinned more than once"),
    (lambda: gpu_problems(lock=re.sub(r"(?m)^vllm==.*\n", "", GPU)), "vllm (vllm==0.32.0) is not in the lock"),
    (lambda: gpu_problems(pyproject=swap(PYPROJECT, '"vllm==0.32.0"', '"vllm==0.33.0"')),
     "vllm==0.32.0 does not satisfy vllm==0.33.0"),
    (lambda: gpu_problems(lock=re.sub(r"(?m)^openenv==.*\n", "", GPU)), "openenv (openenv==0.10.0) is not in the lock"),
    (lambda: gpu_problems(lock=swap(GPU, "nvidia-nccl-cu13==", "nvidia-nccl-cu12==")),
     "CUDA libraries of majors [12, 13] in one lock"),
    (lambda: gpu_problems(containerfile=swap(CONTAINERFILE, "nvidia/cuda:13.", "nvidia/cuda:12.")),
     "the Containerfile's base is CUDA 12, the lock's libraries CUDA 13"),
    (lambda: lockcheck.problems(swap(CPU, "# removed after install: torchvision torchaudio torchcodec", ""), PYPROJECT,
                                extras=("cpu", "test", "tasks", "envs")),
     "torchaudio==2.11.0 is not torch 2.13's release (2.13)"),
])
def test_a_planted_mismatch_is_found(plant, expected):
    assert expected in plant()
