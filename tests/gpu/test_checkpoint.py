"""Checkpoints written on CUDA: a DCP round trip on the device, and `minirl export` of one (its
Trainer loads on the CPU, as on a login node) into a folder transformers loads."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import kit

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["one-gpu", "fsdp2"])
def test_a_cuda_checkpoint_round_trips_and_exports_for_transformers(device, path, request, tmp_path):
    from minirl.config import recipes
    from minirl.disk.store import Checkpoint
    from minirl.models.shapes import TINY
    from minirl.publish.export import export
    from minirl.setup.tokenizer import build_tokenizer
    from minirl.train.hf_io import save_hf_folder
    from minirl.train.sft import sft_loss
    from minirl.train.trainer import Trainer

    if path == "fsdp2":
        request.getfixturevalue("one_rank_group")
    base = save_hf_folder(tmp_path / "base", TINY, Trainer(TINY, lr=0.0, seed=1).model.state_dict(),
                          tokenizer_dir=build_tokenizer(tmp_path / "tok", TINY.vocab_size, TINY.max_seq_len))
    run = tmp_path / "ws" / "runs" / "r1"
    run.mkdir(parents=True)
    rec = recipes.load(None, [f"model.path={base}"])
    (run / "recipe.toml").write_text(rec.to_toml())

    kw = dict(lr=1e-2, seed=0, device=device, param_dtype="bfloat16", shard=path == "fsdp2")
    tr = Trainer(TINY, **kw)
    tr.load_hf(base)
    batch = kit.rl_batch(TINY, prompts=2, group=2, prompt_len=5, response_len=6)
    for _ in range(2):
        tr.forward_backward(batch, sft_loss)
        tr.optim_step()
    ckpt = tr.save(run / "checkpoints" / "step_000002", {"step": 2})
    weights = {k: v.cpu() for k, v in tr.full_state_dict().items()}

    again = Trainer(TINY, **{**kw, "seed": 5})
    assert again.load(ckpt)["step"] == 2
    assert all(torch.equal(v.cpu(), weights[k]) for k, v in again.full_state_dict().items())
    ours, theirs = (next(iter(t.optim.state.values())) for t in (tr, again))
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = (s[key].full_tensor() if hasattr(s[key], "full_tensor") else s[key] for s in (ours, theirs))
        assert a.device.type == device.type and torch.equal(a, b)
    assert float(theirs["step"]) == 2.0

    out = export(run, tmp_path / "export", Checkpoint(ckpt, 2, True), why="tests/gpu")
    cpu = Trainer(TINY, lr=0.0)
    cpu.load(ckpt, with_optim=False)
    assert all(torch.equal(v, weights[k]) for k, v in cpu.full_state_dict().items())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(batch.tokens_BL[:, :-1]).logits
    hf_logp = torch.log_softmax(logits, -1).gather(-1, batch.tokens_BL[:, 1:, None]).squeeze(-1)
    ref, _, _ = cpu.logprobs(batch)
    m = batch.mask_BT.bool()
    gap = float((hf_logp[m] - ref[m]).abs().max())
    kit.record(f"export [{path}]", {"transformers_vs_trainer_logp_max": gap})
    assert gap < 1e-4
