"""Datasets' rows, read by `datasets` in a Python process of their own (one process for the sources
of one `start`): a local JSONL/Parquet file (or folder) or a Hub id.

Why a process: `datasets` imports pandas, pyarrow, aiohttp and fsspec, ~90 MiB that stay in a
process for good once imported, while a run keeps its rows as plain Python lists
(docs/results/memory.md). The child reads the rows and hands them back pickled; everything that
decides what to read (a local path or the Hub, the files of a folder, the Hub probe of
`hub.need_hub`) is decided here first, so the child only loads. It inherits the environment: the
Hub's variables (`HF_HOME`, `HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`, `HF_ENDPOINT`, `HF_TOKEN`)
apply as they would in this process.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minirl.errors import UsageError
from minirl.models import hub


@dataclass(frozen=True)
class Rows:
    """The rows of a dataset split, in file order, as `datasets` decoded them."""

    column_names: list[str]
    rows: list[dict[str, Any]]  # decoded from Arrow once, in the loader's process


def load_rows(spec: str, *, base: Path | None = None, split: str = "train", config: str | None = None,
              instead: str | None = None, typed: tuple[str, ...] = ()) -> Rows:
    """The rows of a local file/folder (resolved against `base`) or a Hub dataset id.
    instead: what to pass rather than a Hub id when the Hub cannot be had (one line, hub.need_hub).
    typed: fields whose every row must hold one type (local files: `_one_type_per_field`)."""
    asked = dict(spec=spec, base=base, split=split, config=config, instead=instead, typed=typed)
    return start([asked])[0].result()


def start(asked: list[dict]) -> list["Loading"]:
    """`load_rows` of each of `asked` (its keyword arguments) begun, all in one loader process (one
    import of `datasets`), which works while this one does something else."""
    loads = [Loading(**kw) for kw in asked]
    todo = [load for load in loads if load.request is not None]
    if todo:
        child = _Child([load.request for load in todo])
        for i, load in enumerate(todo):
            load.child, load.index = child, i
    return loads


class Loading:
    """One source's load: `result()` waits for its rows, or raises the load's error (one found
    before the loader process started too, so errors come in the order their results are asked for)."""

    def __init__(self, spec: str, *, base: Path | None = None, split: str = "train", config: str | None = None,
                 instead: str | None = None, typed: tuple[str, ...] = ()):
        self.spec, self._error, self._files = spec, None, None
        self.request: tuple[dict, tuple[str, ...]] | None = None  # what the loader process is asked
        self.child: _Child | None = None  # the process `start` asked, and where in its answers this one's is
        self.index = 0
        local = Path(spec) if Path(spec).is_absolute() or base is None else base / spec
        self._instead = instead or f"give a local copy of {spec!r} (a .jsonl or .parquet path) instead"
        try:
            if local.exists():
                self._files = self._local_files(local)
                kind = "parquet" if self._files[0].suffix == ".parquet" else "json"
                self.request = ({"path": kind, "data_files": [str(f) for f in self._files], "split": "train"}, typed)
                return
            if local.suffix in (".jsonl", ".json", ".parquet", ".csv") or spec.startswith((".", "/")):
                raise UsageError(f"dataset file {local} not found")  # a path, not a Hub id: never ask the Hub
            hub.need_hub(f"dataset {spec!r}", instead=self._instead, datasets=True)
            self.request = ({"path": spec, "name": config, "split": split}, ())
        except UsageError as e:
            self._error = e
        except OSError as e:  # an unreadable folder or file: one line as well
            self._error = UsageError(f"cannot load dataset {spec!r}: {type(e).__name__}: {e}")

    @staticmethod
    def _local_files(local: Path) -> list[Path]:
        files = sorted(local.glob("*.jsonl")) + sorted(local.glob("*.parquet")) if local.is_dir() else [local]
        if not files:
            raise UsageError(f"no .jsonl or .parquet files in {local}")
        for f in files:
            if f.stat().st_size == 0:
                raise UsageError(f"dataset file {f} is empty")
        _same_fields(local, files)
        return files

    def result(self) -> Rows:
        if self._error is not None:
            raise self._error
        ok, got = self.child.answer(self.index)
        if not ok:
            if self._files is None and hub.offline(datasets=True):  # a Hub id the cache did not have
                raise UsageError(f"dataset {self.spec!r} is not in the local cache and HF_HUB_OFFLINE / "
                                 f"HF_DATASETS_OFFLINE is set; {self._instead}")
            raise UsageError(f"cannot load dataset {self.spec!r}: {got}")
        if self._files is not None:
            _one_type_per_field(got["json_fields"], self.spec, self._files)
        return Rows(got["column_names"], got["rows"])

    def cancel(self) -> None:
        """Its loader process stopped, where the rows are no longer wanted (an earlier check failed)."""
        if self.child is not None:
            self.child.stop()


class _Child:
    """The loader process of one `start`: asked once, answered once, each answer (ok, rows or the
    failure's line) in the order asked."""

    def __init__(self, requests: list):
        root = str(Path(__file__).resolve().parents[2])  # the child imports this very minirl
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "minirl.data.loader"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self._proc.stdin.write(pickle.dumps(requests))  # a few hundred bytes: never blocks
        self._proc.stdin.close()
        self._proc.stdin = None  # communicate() then only reads
        self._n, self._answers = len(requests), None

    def answer(self, i: int) -> tuple[bool, Any]:
        if self._answers is None:
            out, err = self._proc.communicate()
            if self._proc.returncode == 0:
                self._answers = pickle.loads(out)
            else:  # killed, out of memory: what it said last, for every source it was asked for
                said = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
                line = f"the loader's process exited with code {self._proc.returncode}" + (
                    f" ({said[-1][:200]})" if said else "")
                self._answers = [(False, line)] * self._n
        return self._answers[i]

    def stop(self) -> None:
        if self._proc.returncode is None:
            self._proc.kill()
            self._proc.communicate()


def _load(args: dict, typed: tuple[str, ...]) -> dict:
    """The child's work (its `__main__` below)."""
    import datasets

    datasets.disable_progress_bars()
    rows = datasets.load_dataset(**args)
    return {"column_names": list(rows.column_names), "rows": rows.to_list(),  # Arrow to Python once
            "json_fields": [f for f in typed if type(rows.features.get(f)).__name__ == "Json"]}


def _same_fields(folder: Path, files: list[Path]) -> None:
    """A folder loads as one dataset only when its files have the same fields (else `datasets`
    says only "An error occurred while generating the dataset"): each file's first row, compared."""
    if len(files) < 2:
        return
    import json

    fields = {}
    for f in files:
        try:
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq  # deferred: a schema read alone, in a folder of Parquet files

                fields[f.name] = tuple(sorted(pq.read_schema(f).names))
            else:
                with f.open() as fh:
                    fields[f.name] = tuple(sorted(json.loads(fh.readline())))
        except (OSError, ValueError, AttributeError, TypeError):
            return  # unreadable: `datasets` says what is wrong with it
    kinds = sorted(set(fields.values()))
    if len(kinds) > 1:
        a = next(n for n, k in fields.items() if k == kinds[0])
        b = next(n for n, k in fields.items() if k == kinds[1])
        raise UsageError(f"dataset folder {folder} holds files with different fields ({a}: {', '.join(kinds[0])}; "
                         f"{b}: {', '.join(kinds[1])}), which do not load as one dataset; pass one file")


def _one_type_per_field(json_fields: list[str], spec: str, files: list[Path]) -> None:
    """A field whose rows hold values of different types (a number among strings) is typed `Json`
    by `datasets`, whose rows then read as JSON text: every prompt '"760+455="', quotes and all
    (#82). Refused, naming the file and line of the first value whose type is not the field's most
    common one (read from the files themselves: the decoded column has lost the types)."""
    import collections
    import json

    for f in json_fields:
        where = []  # (file, line, type) of each row's value
        for path in (x for x in files if x.suffix != ".parquet"):
            with path.open() as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        v = json.loads(line).get(f)
                        where.append((path, n, None if v is None else type(v).__name__, v))
        common = collections.Counter(k for *_, k, _ in where if k).most_common(1)
        odd = next((w for w in where if w[2] and common and w[2] != common[0][0]), None)
        if odd is None:
            raise UsageError(f"dataset {spec!r}: field {f!r} holds values of different types, which `datasets` reads "
                             "as JSON text: one type per field")
        path, n, kind, v = odd
        raise UsageError(f"dataset {spec!r} ({path.name} line {n}): field {f!r} holds a {kind} ({v!r}) where its other "
                         f"rows hold a {common[0][0]}: one type per field (quote it, or fix the row)")


def _child() -> None:
    requests = pickle.loads(sys.stdin.buffer.read())
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # what the libraries print goes to stderr: stdout carries the answers alone
    answers = []
    for args, typed in requests:
        try:
            answers.append((True, _load(args, typed)))
        except Exception as e:  # noqa: BLE001 - any loader failure, as the one line the parent raises
            first = (str(e).strip().splitlines() or [""])[0][:200]
            answers.append((False, f"{type(e).__name__}{': ' + first if first else ''}"))
    with os.fdopen(answer_fd, "wb") as out:
        out.write(pickle.dumps(answers))


if __name__ == "__main__":
    _child()
