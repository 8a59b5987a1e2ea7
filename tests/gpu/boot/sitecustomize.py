"""Python runs this at the start of every process whose path holds this folder: run-on-device.sh
puts it there for every process a GPU step starts, `minirl run`'s subprocesses and engine
processes included. It loads the torch 2.11 stand-in (../shared/tools/gpu/torch211_shim.py, carried
in .gpu/) before anything imports TorchTitan: the first visit's `minirl run`, started by the
sequence, failed at import without it (#72). On torch 2.13 the stand-in changes nothing. Where it
cannot be imported Python says so and goes on; the sequence's probe (sequence.py) then fails the
step in one line."""

import torch211_shim  # noqa: F401
