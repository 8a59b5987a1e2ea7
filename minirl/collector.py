"""How often the garbage collector runs in minirl's processes.

Importing torch, TorchTitan, transformers and vLLM creates millions of objects that live until the
process ends. With CPython's default thresholds (700, 10, 10) the collector walks the young
generation every 700 allocations and the older ones every 7,000 and 70,000, over objects that are
never garbage: about a fifth of those imports' time (docs/results/startup.md). A young pass every
100,000 allocations keeps cycles collected, hundreds of times less often; nothing computed changes.
"""

from __future__ import annotations

import gc

THRESHOLDS = (100_000, 50, 100)


def collect_less_often() -> None:
    """Set the collector's thresholds for a process that imports the big libraries: called first
    thing by the CLI and by each engine process."""
    gc.set_threshold(*THRESHOLDS)
