"""Checks that a lock (.ci/constraints-*.txt) and pyproject.toml cannot drift apart; tests/test_locks.py
runs them in CI on both locks and on planted mismatches.

    python .ci/lockcheck.py            the problems of both locks, one a line; exit 1 if any
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# torch's companions, released together: torchvision's minor is torch's + 15 (0.28 ↔ 2.13),
# torchaudio's equals torch's (2.13 ↔ 2.13)
COMPANION_MINOR = {"torchvision": (0, 15), "torchaudio": (2, 0)}


def pins(lock_text: str) -> tuple[dict[str, Version], list[str]]:
    """name -> version of every `name==version` line, and the names pinned twice."""
    out, twice = {}, []
    for line in lock_text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if m:
            name = canonicalize_name(m.group(1))
            if name in out:
                twice.append(name)
            out[name] = Version(m.group(2))
    return out, twice


def removed_after_install(lock_text: str) -> set[str]:
    """The names of a `# removed after install: a b c` line (.ci/setup uninstalls them)."""
    m = re.search(r"^# removed after install: (.*)$", lock_text, re.MULTILINE)
    return {canonicalize_name(n) for n in m.group(1).split()} if m else set()


def problems(lock_text: str, pyproject_text: str, *, extras: tuple[str, ...],
             containerfile_text: str | None = None) -> list[str]:
    """What is wrong with a lock for pyproject's dependencies plus `extras`: a direct requirement
    unpinned or outside its range, a package pinned twice, torch's companions from another
    release, CUDA libraries of two majors, and (with the Containerfile) a base image of another
    CUDA major than the locked libraries."""
    toml = tomllib.loads(pyproject_text)
    project = toml["project"]
    wanted = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e]),
              *toml.get("tool", {}).get("minirl", {}).get("installed-without-pins", [])]
    locked, twice = pins(lock_text)
    found = [f"{n} is pinned more than once" for n in sorted(set(twice))]
    for spec in wanted:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if name not in locked:
            found.append(f"{req.name} ({spec}) is not in the lock")
        elif not req.specifier.contains(locked[name], prereleases=True):
            found.append(f"{req.name}=={locked[name]} does not satisfy {spec}")
    removed = removed_after_install(lock_text)
    torch = locked.get("torch")
    if torch is not None:
        for comp, (major, offset) in COMPANION_MINOR.items():
            v = locked.get(comp)
            if v is not None and comp not in removed and (v.major, v.minor) != (major, torch.minor + offset):
                found.append(f"{comp}=={v} is not torch {torch.major}.{torch.minor}'s release "
                             f"({major}.{torch.minor + offset})")
    # the CUDA libraries torch links against (nvidia-cutlass-dsl ships builds for two majors by design)
    cuda = {int(m.group(1)) for n in locked if (m := re.match(r"nvidia-(?:cudnn|nccl|cusparselt|nvshmem)-cu(\d+)$", n))}
    runtime = locked.get("nvidia-cuda-runtime")
    if runtime is not None:
        cuda.add(runtime.major)
    if len(cuda) > 1:
        found.append(f"CUDA libraries of majors {sorted(cuda)} in one lock")
    if containerfile_text is not None and cuda:
        m = re.search(r"^FROM\s+nvidia/cuda:(\d+)\.", containerfile_text, re.MULTILINE)
        if m is None or int(m.group(1)) not in cuda:
            found.append(f"the Containerfile's base is CUDA {m.group(1) if m else '?'}, the lock's libraries CUDA "
                         f"{max(cuda)}")
    return found


def main() -> int:
    pyproject = (ROOT / "pyproject.toml").read_text()
    found = [f"cpu: {p}" for p in problems((ROOT / ".ci/constraints-cpu.txt").read_text(), pyproject,
                                             extras=("cpu", "test", "tasks", "envs"))]
    found += [f"gpu: {p}" for p in problems((ROOT / ".ci/constraints-gpu.txt").read_text(), pyproject,
                                              extras=("gpu", "test", "tasks", "envs"),
                                              containerfile_text=(ROOT / "Containerfile").read_text())]
    print("\n".join(found) or "both locks agree with pyproject.toml")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
