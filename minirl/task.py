"""The embedded synthetic task: 3-digit addition with an exactly verifiable answer.

"123+456=" -> "579<eos>": 3–4 answer digits plus EOS, each digit depending on a carry from the
digit to its right, so the policy has several tokens of dependent work per response. Train and
held-out splits are disjoint in (a, b). Graded by `rewards.builtin.ArithGrader`.

Calibrated on the 2-core CPU (PLATFORM.md): ~1,000 cold-start SFT steps leave a 1M-param MoE at
~45–65% held-out accuracy, which RL lifts by 25+ points within minutes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LO, HI = 100, 999


def make_splits(train_size: int, heldout_size: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    total = train_size + heldout_size
    while len(pairs) < total:
        pairs.add((rng.randint(LO, HI), rng.randint(LO, HI)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    recs = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ordered]
    return recs[:train_size], recs[train_size:]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path
