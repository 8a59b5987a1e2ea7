"""One writer per run folder: an OS file lock, held for the life of the process that writes it.

`minirl run` (a new run, `--resume`, `--resume auto`) and `minirl lab` lock `FOLDER/.writer.lock`
before they change anything there and hold it until they exit; under torchrun rank 0 holds it
for the job and the other ranks learn its answer (loop.py). A second writer is refused in one
line naming the holder. The lock is a POSIX record lock (`lockf`): the kernel drops it when its
process dies (SIGKILL, an OOM kill, power loss), so a dead writer never blocks a resume and
nobody unlocks by hand; unlike `flock`, it is not inherited by the forked children a run keeps
(the grading pool, the engine in its own process), which could outlive it. Readers (`status`, `export`,
`eval`, `doctor`) take no lock: checkpoints appear by the rename of a whole folder (atomic.py)
and readers list only complete ones (store.complete_checkpoints).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from minirl.errors import UsageError

LOCK_FILE = ".writer.lock"


class RunLock:
    """The lock on `folder`, taken at construction (a UsageError naming the holder if another
    process has it) and held until `release` or this process's end."""

    def __init__(self, folder: Path, *, what: str = "run"):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EAGAIN / EACCES: held
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(f"{what} {self.folder} is being written by {holder}; "
                             f"see `minirl status`, or wait for it to end") from None
        # who holds it, for the refusal above; the lock itself is the kernel's, not this text
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = None


def _holder(fd: int) -> str:
    try:
        d = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["since"])))
        return f"pid {int(d['pid'])} on {d['host']} (since {since})"
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"
