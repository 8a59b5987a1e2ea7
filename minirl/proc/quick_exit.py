"""End a process whose work is done without the interpreter's teardown.

Once a command has returned (its files closed and renamed into place) or an engine's process has
answered its last call, what Python's own exit still does is free some 10,000 modules' objects
one by one and release each vLLM engine, which collects every object the engine froze: seconds
after the last line, on every `minirl` command and every engine process (figures:
docs/results/startup.md). `quick_exit` keeps what matters at exit and skips the rest: threads that
are not daemons are waited for, the exit handlers run (temporary folders, child processes,
logging, the metrics sinks' libraries; an engine is not shut down), the streams are flushed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def quick_exit(code: int | str | None = 0) -> None:
    """Exit now with `code`, as `sys.exit(code)` would, after the exit handlers."""
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("text"): Python prints it and exits with 1
        print(code, file=sys.stderr)
        code = 1
    lifetime = sys.modules.get("minirl.rollout.lifetime")  # imported where an engine was built
    if lifetime is not None:
        lifetime.process_ends()  # an engine still alive is left to the process's end: its shutdown frees memory
    for t in threading.enumerate():
        if t is not threading.main_thread() and t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say to it
            pass
    os._exit(code)
