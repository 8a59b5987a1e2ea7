"""Crash-safe file writes: a file or folder is either the old one or the complete new one.

A writer fills `<name>.tmp` and renames it into place; rename is atomic on POSIX, so a SIGKILL,
OOM kill or full disk at any moment leaves the previous version intact. Folders on their way out
are renamed to `<name>.del` before they are deleted, so a half-deleted checkpoint never looks like
a checkpoint. Readers ignore every name with a suffix.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_dir(path: Path) -> None:
    """Rename, then delete: an interrupted delete leaves `<name>.del`, never a damaged `<name>`."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(path.name + ".del")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def sweep(folder: Path) -> None:
    """Delete what interrupted writers and deleters left behind (`*.tmp`, `*.del`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for p in list(folder.glob("*.tmp")) + list(folder.glob("*.del")):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def umask() -> int:
    """This process's umask (read by setting it and putting it back: the one way POSIX offers)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
