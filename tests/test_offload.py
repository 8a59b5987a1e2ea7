"""train.offload = "optimizer": Adam's moments in host memory between updates (train/offload.py)."""

import weakref

import torch

from minirl.models.shapes import TINY
from minirl.train import offload
from minirl.train.batch import build_batch
from minirl.train.sft import sft_loss
from minirl.train.trainer import Trainer

BATCH = build_batch([[4, 5, 16]] * 4, [[6, 2, 9]] * 4, None, None, pad_id=0)


def _steps(tr: Trainer, n: int) -> None:
    for _ in range(n):
        tr.forward_backward(BATCH, sft_loss)
        tr.optim_step()


def _moments(tr: Trainer) -> list[torch.Tensor]:
    return [v for s in tr.optim.state.values() for k, v in s.items() if k != "step"]


def test_updates_after_offload_and_reload_are_bit_identical_to_updates_without():
    kept, parked = Trainer(TINY, lr=1e-3, seed=0), Trainer(TINY, lr=1e-3, seed=0, offload="optimizer")
    _steps(kept, 3)
    _steps(parked, 3)
    for (n, a), b in zip(kept.model.state_dict().items(), parked.model.state_dict().values()):
        assert torch.equal(a, b), n
    for a, b in zip(_moments(kept), _moments(parked)):
        assert torch.equal(a, b)


def test_a_round_trip_drops_the_devices_copy_and_moves_every_moment():
    """On the CPU 'host' and 'device' are one memory: the round trip still copies, and the old
    tensors are released (nothing else holds them), which is what frees a GPU's memory."""
    tr = Trainer(TINY, lr=1e-3, seed=0)
    _steps(tr, 1)
    before = _moments(tr)
    values = [t.clone() for t in before]
    refs = [weakref.ref(t) for t in before]
    nbytes = sum(t.nbytes for t in before)
    del before
    assert offload.to_host(tr.optim, "cpu") == nbytes == sum(p.nbytes for p in tr.model.parameters()) * 2
    assert all(r() is None for r in refs)  # the optimizer held the only reference
    assert all(torch.equal(a, b) for a, b in zip(values, _moments(tr)))
    assert offload.to_device(tr.optim) == 0  # on the CPU the host is the parameters' own device


def test_a_checkpoint_saved_while_offloaded_resumes_bit_identically(tmp_path):
    a = Trainer(TINY, lr=1e-3, seed=0, offload="optimizer")
    _steps(a, 2)
    a.save(tmp_path / "s2", {"step": 2})
    b = Trainer(TINY, lr=1e-3, seed=5, offload="optimizer")
    b.load(tmp_path / "s2")
    _steps(a, 1)
    _steps(b, 1)
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(x, y)
