"""How often the garbage collector runs while a minirl process starts.

Importing torch, TorchTitan, transformers and vLLM creates millions of objects that live until the
process ends. With CPython's default thresholds (700, 10, 10) the collector walks the young
generation every 700 allocations and the older ones every 7,000 and 70,000, over objects that are
never garbage: about a fifth of those imports' time (docs/results/startup.md). Until its engine
is built a process collects every 100,000 allocations; then the defaults come back, so that
garbage in cycles (CUDA tensors among it, on a GPU) is freed as promptly as before while it
trains and samples. Nothing computed changes.

A vLLM engine's start collects the whole heap several times (its model loader, its memory
profile) and freezes it at the end (`EngineCore.__init__`: `freeze_gc_heap`). `freeze_before_engine`
does that freeze first, so those collections walk only what the engine allocates: the objects
frozen are the ones vLLM freezes anyway, a little earlier.
"""

from __future__ import annotations

import gc

STARTING = (100_000, 50, 100)
_usual: tuple[int, int, int] | None = None


def collect_less_often() -> None:
    """The start's thresholds: called first thing by the CLI and by each engine process."""
    global _usual
    if _usual is None:
        _usual = gc.get_threshold()
    gc.set_threshold(*STARTING)


def collect_as_usual() -> None:
    """The thresholds as they were before `collect_less_often` (nothing where it was not called):
    once an engine is built (rollout.make_engine, the engine process)."""
    global _usual
    if _usual is not None:
        gc.set_threshold(*_usual)
        _usual = None


def freeze_before_engine() -> None:
    """Collect once, then freeze what lives (what vLLM's engine freezes at the end of its start):
    called right before a vLLM engine is built. vLLM's shutdown unfreezes it again."""
    gc.collect()
    gc.freeze()
