"""TorchTitan's parallelism on CPU ranks (gloo, torchrun --nproc-per-node 2): FSDP2 over both
ranks, and expert parallel 2 with and without Routing Replay, each give the loss and the updated
weights of one process on the whole batch."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.mark.parametrize("ep, replay", [(1, "off"), (2, "off"), (2, "r2"), (2, "r3")],
                         ids=["fsdp2", "fsdp2+ep2", "ep2+r2", "ep2+r3"])
def test_two_ranks_update_like_one_process(ep, replay, tmp_path):
    from dist_worker import fixed_batch, fixed_routes, one_update

    from minirl.models import TINY
    from minirl.train import Trainer

    out = tmp_path / "out.pt"
    with socket.socket() as sock:  # a free port for the rendezvous on this machine
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(port),
                        str(ROOT / "tests" / "dist_worker.py"), "--ep", str(ep), "--replay", replay, "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = torch.load(out)

    one = Trainer(TINY, lr=1e-2, seed=0)
    batch = fixed_batch()
    loss, grads = one_update(one, batch, replay, fixed_routes(batch, TINY.n_layers, TINY.top_k, TINY.num_experts))
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["grads"].keys() == grads.keys() and len(grads) == len(list(one.model.parameters()))
    for k, g in grads.items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-7)
    ref, start = one.model.state_dict(), Trainer(TINY, lr=1e-2, seed=0).model.state_dict()
    assert got["weights"].keys() == ref.keys()
    for k, v in ref.items():
        # Adam's first step is lr·g/(|g| + ε): it turns 1e-9 differences of near-zero gradient
        # entries into up to ~1e-5 of a 1e-2 step, so weights are compared to 1% of the step
        torch.testing.assert_close(got["weights"][k], v, rtol=0, atol=1e-4)
    assert sum(not torch.equal(v, start[k]) for k, v in ref.items()) > len(ref) // 2  # the update moved them
