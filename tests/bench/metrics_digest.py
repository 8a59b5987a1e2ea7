"""Whether two runs trained alike: a digest of every non-timing metric of every step, and the held-out figures.

    .venv/bin/python tests/bench/metrics_digest.py RUN [OTHER_RUN]

With one run folder, prints its digest; with two, also whether they are identical and, if not,
the first step and metric where they part. Timing (`timing/*`, and the summary's clocks) is left
out: it differs between any two runs. Used to show that a change moved no number (a refactor, a
memory cut): the same seeded run before and after, on the same machine. Keys that only the second
run's rows have (metrics a change added) are named and left out of the comparison; the digests
then differ, and the line says the rows agree on every key the first run has.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def rows(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append({k: v for k, v in row.items() if not k.startswith("timing/")})
    return out


def heldout(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    return {"start": summary["heldout"]["start"], "end": summary["heldout"]["end"]}


def digest(run: Path) -> str:
    body = json.dumps({"rows": rows(run), "heldout": heldout(run)}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def main() -> None:
    runs = [Path(a) for a in sys.argv[1:]]
    if not 1 <= len(runs) <= 2:
        raise SystemExit(__doc__)
    for run in runs:
        h = heldout(run)
        metric = next(k for k in h["end"] if k.startswith("avg@"))
        print(f"{run}: {len(rows(run))} rows, held-out {metric} {h['start'][metric]} -> {h['end'][metric]}, "
              f"digest {digest(run)}")
    if len(runs) == 2:
        a, b = rows(runs[0]), rows(runs[1])
        added = sorted({k for r in b for k in r} - {k for r in a for k in r})
        if added:
            print(f"keys only the second run has, left out: {', '.join(added)}")
            b = [{k: v for k, v in r.items() if k not in added} for r in b]
        for ra, rb in zip(a, b):
            keys = sorted(ra.keys() | rb.keys())
            differ = [k for k in keys if json.dumps(ra.get(k)) != json.dumps(rb.get(k))]  # nan equals nan here
            if differ:
                print(f"differ first at step {ra.get('step')}: {differ[0]} {ra.get(differ[0])} vs {rb.get(differ[0])}")
                return
        same = len(a) == len(b) and heldout(runs[0]) == heldout(runs[1])
        if same:
            print("identical on every key the first run has" if added else "identical")
        else:
            print(f"the rows agree as far as both go ({len(a)} and {len(b)}); held-out figures "
                  f"{'agree' if heldout(runs[0]) == heldout(runs[1]) else 'differ'}")


if __name__ == "__main__":
    main()
