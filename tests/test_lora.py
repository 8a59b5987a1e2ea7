"""LoRA RL (train/lora.py, [train.lora]): what trains, step 0, the merged weights the engine gets,
and the recipe's rules. One process on the tiny MoE (and a dense shape for `mlp`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minirl import recipe
from minirl.errors import UsageError
from minirl.models import KNOWN_SHAPES, TINY
from minirl.train import lora
from minirl.train.batch import build_batch
from minirl.train.objective import loss_for
from minirl.train.trainer import Trainer
from minirl.validator import Platform, lora_targets, validate

ALL = ("q", "k", "v", "o", "experts")


def _batch(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    prompts = [[4, 5, 16]] * 6
    resps = [[int(x) for x in torch.randint(3, 30, (n,), generator=g)] + [2] for n in (1, 3, 2, 4, 1, 2)]
    return build_batch(prompts, resps, [[-1.0 - 0.1 * i for i in range(len(r))] for r in resps],
                       [0.5, -0.5, 1.0, -1.0, 0.2, -0.2], pad_id=0)


def _lora_trainer(rank=4, targets=ALL, shape=TINY, **kw):
    return Trainer(shape, lr=1e-2, seed=0, lora={"rank": rank, "alpha": 8.0, "targets": targets}, **kw)


def _update(tr: Trainer, b) -> None:
    fn = loss_for(recipe.load(None).loss)
    old, _, _ = tr.logprobs(b)
    tr.forward_backward(b.with_old_logp(old), fn)
    tr.optim_step()


def test_only_the_adapters_train_and_step_0_is_the_base_model():
    b = _batch()
    base = Trainer(TINY, lr=1e-2, seed=0)
    tr = _lora_trainer()
    tr.load_weights(base.full_state_dict())
    torch.testing.assert_close(tr.logprobs(b)[0], base.logprobs(b)[0], rtol=0, atol=0)  # B = 0: exactly the base

    before = {k: v.clone() for k, v in tr.model.state_dict().items() if not lora.is_adapter(k)}
    fn = loss_for(recipe.load(None).loss)
    old, _, _ = tr.logprobs(b)
    tr.forward_backward(b.with_old_logp(old), fn)
    with_grad = {n for n, p in tr.model.named_parameters() if p.grad is not None}
    assert with_grad and all(lora.is_adapter(n) for n in with_grad)
    adapters = {n for n, p in tr.model.named_parameters() if lora.is_adapter(n)}
    assert {n.rsplit(".", 2)[0] for n in adapters} >= {"layers.0.attention.qkv_linear.wq", "layers.0.attention.wo",
                                                       "layers.0.moe.routed_experts.inner_experts"}
    assert not any("router" in n or "embeddings" in n or "lm_head" in n for n in adapters)
    tr.optim_step()
    state = tr.optim.state_dict()["state"]
    assert len(state) == len(adapters)  # Adam moments for the adapters only
    after = tr.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the base never moves
    assert not torch.equal(tr.logprobs(b)[0], base.logprobs(b)[0])  # the adapters did


def test_the_merged_weights_compute_what_the_adapted_model_computes():
    """W + s·B·A loaded into a plain model gives the adapted model's log-probs: what the engine
    and an export receive."""
    b = _batch()
    tr = _lora_trainer()
    for _ in range(2):
        _update(tr, b)
    merged = tr.full_state_dict()
    assert not any(lora.is_adapter(k) for k in merged)
    plain = Trainer(TINY, lr=1e-2, seed=0)
    plain.load_weights(merged)
    torch.testing.assert_close(plain.logprobs(b)[0], tr.logprobs(b)[0], rtol=0, atol=1e-5)
    assert tr.hf_views() is None  # no live views: the engine's weights are made at each sync
    hf = tr.hf_state_dict()
    assert set(hf) == set(plain.hf_state_dict())


def test_a_dense_models_mlp_adapters_and_rank_bounds():
    dense = dataclasses.replace(KNOWN_SHAPES["Qwen3-0.6B"], n_layers=1, dim=64, n_heads=2, n_kv_heads=1,
                                head_dim=32, hidden_dim=96, vocab_size=32, max_seq_len=64)
    tr = _lora_trainer(rank=2, targets=("mlp",), shape=dense)
    names = {n.rsplit(".", 2)[0] for n, _ in tr.model.named_parameters() if lora.is_adapter(n)}
    assert names == {f"layers.0.feed_forward.w{i}" for i in (1, 2, 3)}
    assert lora_targets("all", dense) == ("q", "k", "v", "o", "mlp")
    assert lora_targets("all", TINY) == ALL


@pytest.mark.parametrize("sets, error", [
    (["train.lora.rank=-1"], "train.lora.rank = -1; it must be ≥ 0"),
    (["train.lora.rank=4", "train.lora.alpha=0"], "train.lora.alpha = 0.0; it must be > 0"),
    (["train.lora.rank=4", "train.lora.targets=q,gate"], "train.lora.targets = 'q,gate': name weights among"),
])
def test_the_recipe_refuses_lora_it_cannot_mean(sets, error):
    with pytest.raises(UsageError, match=error.replace("(", r"\(").replace(")", r"\)")):
        recipe.load(None, sets)


def test_the_model_and_machine_bound_lora():
    rec = recipe.load(None, ["train.lora.rank=4", "train.lora.targets=q,mlp"])
    with pytest.raises(UsageError, match="names mlp, which this model does not have"):
        validate(rec, None, TINY)
    rec = recipe.load(None, ["train.lora.rank=200"])
    with pytest.raises(UsageError, match=r"train.lora.rank = 200 is above the width of the 'q' weights \(64\)"):
        validate(rec, None, TINY)
    rec = recipe.load(None, ["train.lora.rank=4"])
    validate(rec, Platform("cpu", 1, 2, 16.0), TINY)
    with pytest.raises(UsageError, match="LoRA trains in one process so far"):
        validate(rec, Platform("cpu", 2, 2, 16.0), TINY)
    with pytest.raises(UsageError, match="rollout.overlap = false"):
        validate(recipe.load(None, ["train.lora.rank=4", "rollout.overlap=true"]), Platform("cpu", 1, 2, 16.0), TINY)


def test_the_merged_sync_puts_the_adapted_model_in_the_engine(engine32, tiny_dir):
    """fp32 vLLM after the merged sync scores as the LoRA trainer does (the control test's bound:
    float noise), after real updates that moved it."""

    from minirl.rollout import sync as weight_sync
    from tests.test_rollout import PROMPTS, mean_abs_diff, trainer_logprobs

    groups = engine32.generate(PROMPTS, n=4, temperature=1.0, max_tokens=6, seed=7)
    prompts = [p for p, g in zip(PROMPTS, groups) for _ in g]
    responses = [list(c.token_ids) for g in groups for c in g]
    tr = _lora_trainer(targets=ALL)
    tr.load_hf(tiny_dir)
    before = engine32.score(prompts, responses)
    original = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    try:
        b = build_batch(prompts, responses, None, [1.0 if i % 2 else -1.0 for i in range(len(prompts))], pad_id=0)
        for _ in range(3):
            tr.forward_backward(b, lambda lp, x: (-(lp * x.mask_BT).sum(-1).mul(x.adv_B).mean(), {}))
            tr.optim_step()
        weight_sync.sync(tr, engine32, bucket_bytes=1)  # what the loop calls: no live views with LoRA, buckets
        after = engine32.score(prompts, responses)
        assert mean_abs_diff(after, before) > 0.05  # the adapters moved the policy, and the engine with it
        assert mean_abs_diff(after, trainer_logprobs(tr, prompts, responses)) < 1e-5
    finally:
        engine32.load_weights(original.items())


def test_lora_with_r3_replays_the_engines_routes_on_every_position(engine_r3, tiny_dir):
    """The router is never adapted, so R3 replays the engine's routes through the adapted experts
    exactly as it does without LoRA, before and after updates."""
    from minirl.train.replay import route_agreement
    from tests.test_rollout import capture_batch, fed_positions

    comps, batch, routes = capture_batch(engine_r3)
    fed = fed_positions(comps, batch)
    tr = _lora_trainer()
    tr.load_hf(tiny_dir)
    fn = loss_for(recipe.load(None).loss)
    adv = torch.tensor([0.5 if i % 2 else -0.5 for i in range(len(batch))])
    b = dataclasses.replace(batch, adv_B=adv)
    for _ in range(2):
        old, _, used = tr.logprobs(b, routes=routes, record_routes=True)
        assert route_agreement(used, routes, fed).tolist() == [1.0] * TINY.n_layers
        tr.forward_backward(b.with_old_logp(old), fn, routes=routes)
        tr.optim_step()
    assert any(p.abs().sum() > 0 for n, p in tr.model.named_parameters() if n.endswith(".B") or "B_w" in n)


def test_a_checkpoint_loads_only_into_the_trainer_that_saved_its_adapters(tmp_path):
    """Resume and rollback read the adapters back; a checkpoint never loads silently into a trainer
    without its adapters (DCP would read the base alone), nor a full one into a LoRA trainer."""
    b = _batch()
    tr = _lora_trainer()
    _update(tr, b)
    tr.save(tmp_path / "lora", {"step": 1})
    again = _lora_trainer()
    again.load(tmp_path / "lora")
    torch.testing.assert_close(again.logprobs(b)[0], tr.logprobs(b)[0], rtol=0, atol=0)
    with pytest.raises(UsageError, match="holds LoRA adapters and this trainer has none"):
        Trainer(TINY, lr=0.0).load(tmp_path / "lora")
    with pytest.raises(UsageError, match="another rank"):
        _lora_trainer(rank=2).load(tmp_path / "lora")
    full = Trainer(TINY, lr=1e-2, seed=0)
    full.save(tmp_path / "full", {"step": 0})
    with pytest.raises(UsageError, match="no LoRA adapters"):
        _lora_trainer().load(tmp_path / "full")
    assert Trainer.for_checkpoint(recipe.load(None, ["train.lora.rank=4", "train.lora.alpha=8"]), TINY).lora == {
        "rank": 4, "alpha": 8.0, "targets": ALL}


@pytest.mark.slow
def test_a_lora_run_with_r3_exports_the_merged_model(tmp_path, tiny_dir):
    """`minirl run` with [train.lora] and R3 on the tiny model end to end, then `minirl export` of
    its checkpoint: the run's own HF folder again (export once read the base alone; that merged
    weights are not the base's is test_the_merged_weights_…'s business, a LoRA checkpoint's
    reload test_a_checkpoint_loads_only_…'s, a run killed and resumed test_faults')."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.conftest import ROOT, data_workspace

    ws = data_workspace(tmp_path / "ws", train=64, heldout=8)
    shutil.copytree(tiny_dir, ws / "model" / "coldstart")
    sets = ["train.lora.rank=4", "train.lora.alpha=16", "train.lr=3e-3", "train.replay=r3", "train.prompts_per_step=4",
            "train.group_size=4", "eval.k=1", "eval.every=0"]

    def minirl(*a):
        return subprocess.run([sys.executable, "-m", "cli.main", *a], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "COLUMNS": "200"}, timeout=600)

    r = minirl("run", str(ws), "--steps", "2", *[x for s in sets for x in ("--set", s)])
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = (ws / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2
    assert summary["recipe"]["train"]["lora"]["rank"] == 4 and summary["recipe"]["train"]["replay"] == "r3"
    assert minirl("export", str(ws), str(tmp_path / "out")).returncode == 0
    exported = load_file(next((tmp_path / "out").glob("*.safetensors")))
    own = load_file(next((run / "checkpoints" / "step_000002" / "hf").glob("*.safetensors")))
    assert all(torch.equal(exported[k], own[k]) for k in own)  # both written through the adapters (merged)
