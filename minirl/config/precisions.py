"""The rollout precisions (`rollout.precision`), declared once: their names, mildest
training–inference gap first (the doctor and the lab's dial go in this order), and what each means
for an engine. Everything that lists, checks or maps a precision reads this table.

    fp32, bf16      the engine's dtype
    fp8             W8A8 as CUDA vLLM serves it (`fp8_per_channel`: e4m3 weights with a scale per
                    output row, activations per token); emulated on a CPU (no FP8 kernels there)
    fp8-weights,    the lab's CPU-only levels around it: FP8 weights alone; W8A8 in the coarser
    e5m2, nvfp4     e5m2; W4A4 in NVFP4 (the last two beyond the paper)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    weight_bytes: int  # a byte count per weight of a GPU engine
    emulate: str | None = None  # how a CPU engine emulates it: "w8a8", "w8", "e5m2" or "nvfp4"; None: its dtype
    cpu_only: bool = False  # a lab level: no GPU engine serves it

    @property
    def rounds(self) -> bool:
        """The weights (and activations) round through a low-precision format (FP8 or NVFP4)."""
        return self.emulate is not None

    @property
    def dtype(self) -> str:
        return "float32" if self.name == "fp32" else "bfloat16"


PRECISIONS = {p.name: p for p in (
    Precision("fp32", 4), Precision("bf16", 2), Precision("fp8-weights", 1, "w8", cpu_only=True),
    Precision("fp8", 1, "w8a8"), Precision("e5m2", 1, "e5m2", cpu_only=True), Precision("nvfp4", 1, "nvfp4", cpu_only=True),
)}
NAMES = tuple(PRECISIONS)  # mildest gap first
