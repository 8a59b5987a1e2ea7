"""The OS error behind a failed write, however a library wraps it: an `OSError` itself, one a DCP save
holds in its `CheckpointException` (a failure per rank), one chained as the cause, or a Rust library's
(safetensors' `SafetensorError`: "I/O error: No space left on device (os error 28)"), whose errno its
message says. A full disk or a read-only folder is then one line however deep it was raised."""

from __future__ import annotations

import os
import re

_RUST_IO = re.compile(r"\(os error (\d+)\)")


def os_error_of(e: BaseException | None, *, chained: bool = True) -> OSError | None:
    """The OSError behind `e` (itself, a DCP failure's, one its message names, or with `chained` its cause's
    or context's), else None. Without `chained` an error raised while another was handled is its own."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, stack summary)}
        if isinstance(failures, dict):
            for f in failures.values():
                f = f[0] if isinstance(f, tuple) and f else f  # torch wraps each failure with its stack
                inner = os_error_of(f) if isinstance(f, BaseException) else None
                if inner is not None:
                    return inner
        said = _RUST_IO.search(str(e))
        if said is not None:
            code = int(said.group(1))
            return OSError(code, os.strerror(code))
        e, seen = (e.__cause__ or e.__context__) if chained else None, seen + 1
    return None
