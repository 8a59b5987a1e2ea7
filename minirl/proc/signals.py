"""Signal handlers that live as long as the work they guard.

A command that turns SIGTERM into Ctrl-C (so its cleanup runs) or into "stop after this step" has
nothing left to guard once its work is done: a handler still installed then would raise in whatever
runs next, an exit hook among them (a `KeyboardInterrupt` traceback from atexit, the command's exit
status 0). `handling` installs a handler for a block and puts back what was there before as the block
ends, however it ends: after the work a signal does what it did before the command (terminate)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable


@contextlib.contextmanager
def handling(handler: Callable, signums: Iterable[int] = (signal.SIGTERM,)):
    """`handler` for `signums` while the block runs, the handlers before it restored after."""
    before = {s: signal.getsignal(s) for s in signums}
    for s in before:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
