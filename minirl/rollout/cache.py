"""vLLM's compile cache kept in the workspace, so that a later `run` or `eval` of the same model
starts from what an earlier one compiled (#73: torch.compile started cold on every run, a good
part of the engine's start on the H200: docs/results/gpu-2026-11-28-h200-run.md).

vLLM keeps what it can reuse across starts under VLLM_CACHE_ROOT: compiled artifacts
(torch_compile_cache/, one folder per model and compilation setting), and on every backend its
inspection of the model's class (modelinfos/, which otherwise costs a subprocess at each start).
`use` points it at the workspace's `.cache/vllm` for this process and the engine processes it
starts, before any engine is built, and `CompileCache.reused` says afterwards whether the engine
found everything it needed there already (nothing new was written).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SUBDIR = Path(".cache") / "vllm"  # in a workspace, beside runs/
_GIVEN = os.environ.get("VLLM_CACHE_ROOT")  # the user's own, which wins over the workspace's


def _entries(root: Path) -> set[str]:
    """Every file vLLM keeps there, by its path under the root: compiled artifacts
    (torch_compile_cache/), the model registry's inspection of a model class (modelinfos/), ..."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.is_dir() else set()


@dataclass
class CompileCache:
    path: Path
    before: set[str] = field(default_factory=set)

    @property
    def reused(self) -> bool:
        """An engine started since `use` found what it compiles there: nothing new was added."""
        return bool(self.before) and _entries(self.path) <= self.before

    def describe(self) -> dict:
        return {"path": str(self.path), "reused": self.reused}


def use(workspace_root: Path) -> CompileCache:
    """Point vLLM's caches at the workspace's for this process and its children; call before an
    engine is built. A VLLM_CACHE_ROOT the user set wins."""
    path = Path(_GIVEN or Path(workspace_root) / SUBDIR)
    os.environ["VLLM_CACHE_ROOT"] = str(path)
    return CompileCache(path, _entries(path))
