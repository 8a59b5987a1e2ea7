"""Both installs are pinned (.ci/constraints-{cpu,gpu}.txt) and cannot drift from pyproject.toml or
the Containerfile (.ci/lockcheck.py): every direct requirement pinned within its range, one
version a package, torch's companions from torch's release, one CUDA major, and the image's CUDA
that major; and the environment the tests run in is its lock's, whether uv or pip installed it. Planted
mismatches show that each check can fail."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

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


def installed_against(lock_text: str, installed: dict[str, str]) -> list[str]:
    """How an environment's packages (name -> version) differ from a lock: a pin missing or at another version,
    a package the install removes still there."""
    locked, _ = lockcheck.pins(lock_text)
    removed = lockcheck.removed_after_install(lock_text)
    got = {canonicalize_name(n): v for n, v in installed.items()}
    found = [f"{n} is installed, though the install removes it" for n in sorted(removed & set(got))]
    for name, version in sorted(locked.items()):
        if name in removed:
            continue
        if name not in got:
            found.append(f"{name}=={version} is not installed")
        elif Version(got[name]) != version:
            found.append(f"{name} is {got[name]}, the lock pins {version}")
    return found


def test_the_environment_the_tests_run_in_is_the_locks():
    """The README's set-up installs the lock (through uv, or pip where uv cannot be had): what the suite runs on
    is every pin at its version and nothing the lock removes, whichever installed it."""
    stamp = Path(sys.prefix) / ".minirl-installed"
    if not stamp.exists():
        pytest.skip("not the .venv of bash .ci/setup")
    lock = {"cpu": CPU, "gpu": GPU}[stamp.read_text().split()[0]]
    # what the install put in site-packages: a package's vendored copies (setuptools/_vendor) join sys.path
    # once it is imported
    dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    found = importlib.metadata.distributions(path=dirs)
    installed = {d.metadata["Name"]: d.version for d in found if d.metadata["Name"]}
    assert installed_against(lock, installed) == []
    assert installed_against(lock, {**installed, "torchcodec": "0.17.0"}) == [
        "torchcodec is installed, though the install removes it"]
    torch = lockcheck.pins(lock)[0]["torch"]
    assert installed_against(lock, {**installed, "torch": "2.12.0"}) == [f"torch is 2.12.0, the lock pins {torch}"]
