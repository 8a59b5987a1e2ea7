"""torchao FP8 of the weight sync on the GPU: the quantized weights stay on the device, with the
same bits as the CPU path (the CPU emulation and the cluster then round alike)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import kit

pytestmark = pytest.mark.gpu


def test_fp8_sync_weights_stay_on_the_device_with_the_cpu_bits(device, shape):
    from minirl.rollout.fp8 import fp8_roundtrip, is_fp8_target, quantize_rows
    from minirl.train.trainer import Trainer

    tr = Trainer(shape, lr=0.0, seed=0, device=device, param_dtype="bfloat16")
    hf = {k: v.to(torch.bfloat16) for k, v in tr.hf_state_dict().items()}  # what a bf16 sync sends, on the device
    assert {v.device.type for v in hf.values()} == {device.type}
    out = fp8_roundtrip(hf)
    cpu = fp8_roundtrip({k: v.cpu() for k, v in hf.items()})
    targets = [k for k, v in hf.items() if is_fp8_target(k, v)]
    assert targets and {out[k].device.type for k in out} == {device.type}
    assert all(torch.equal(out[k].cpu(), cpu[k]) for k in hf), [k for k in hf if not torch.equal(out[k].cpu(), cpu[k])][:3]
    assert all(torch.equal(out[k], hf[k]) for k in hf if k not in targets)  # norms, embeddings, routers untouched
    assert not torch.equal(out[targets[0]], hf[targets[0]])  # rounded

    w = hf[targets[0]][None]
    q_dev, q_cpu = quantize_rows(w), quantize_rows(w.cpu())
    assert q_dev.qdata.device.type == device.type and q_dev.qdata.dtype == torch.float8_e4m3fn
    assert torch.equal(q_dev.qdata.cpu().view(torch.uint8), q_cpu.qdata.view(torch.uint8))
    assert torch.equal(q_dev.scale.cpu(), q_cpu.scale)
    err = float((out[targets[0]].float() - hf[targets[0]].float()).norm() / hf[targets[0]].float().norm())
    kit.record(f"fp8 sync [{shape.n_layers}-layer]", {"weights": len(targets), "relative_error": err})
