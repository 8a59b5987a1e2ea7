"""Loop plumbing that needs no engine."""

import pytest
import torch

from minirl.run.lifecycle import _new_run_dir
from minirl.setup.workspace import Workspace
from minirl.train.objective import minibatch_indices, overlong_penalty, sequence_rewards


def test_runs_started_in_the_same_second_get_distinct_folders(tmp_path):
    a, b, c = (_new_run_dir(tmp_path / "runs") for _ in range(3))
    assert len({a, b, c}) == 3 and all(p.is_dir() for p in (a, b, c))
    assert Workspace(tmp_path).runs_newest_first() == [c, b, a]  # --resume and eval's "latest" find the newest


@pytest.mark.parametrize("N", [1, 2, 4, 8])
def test_minibatches_are_whole_groups_covering_every_row_once(N):
    B, G = 32, 8
    parts = minibatch_indices(B, G, N, seed=3)
    assert len(parts) == N and all(len(p) == B * G // N for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(B * G))
    for p in parts:
        groups = p.view(-1, G)
        assert all((g // G == g[0] // G).all() and g[0] % G == 0 for g in groups)  # rows of one prompt, in order
    assert [p.tolist() for p in minibatch_indices(B, G, N, seed=3)] == [p.tolist() for p in parts]


def test_truncated_reward_semantics():
    scores, cut = [1.0, 1.0, 0.0], [False, True, True]
    assert sequence_rewards(scores, cut, "grade").tolist() == [1.0, 1.0, 0.0]
    assert sequence_rewards(scores, cut, "zero").tolist() == [1.0, 0.0, 0.0]


def test_the_overlong_penalty_falls_linearly_over_the_buffer_before_the_limit():
    """DAPO's soft punishment with L_max = 16, L_cache = 4: nothing up to 12 tokens, then a quarter
    of the penalty a token, the whole penalty at the limit; off with no buffer."""
    lengths = torch.tensor([[3, 12, 13], [14, 16, 16]])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [[0.0, 0.0, -0.25], [-0.5, -1.0, -1.0]]
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [[0.0, 0.0, -0.125], [-0.25, -0.5, -0.5]]
    assert overlong_penalty(lengths, 16, 0, 1.0).tolist() == [[0.0] * 3] * 2


def test_resume_keeps_rows_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    from minirl.disk.store import truncate_metrics as _truncate_metrics

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "rollout/rew')  # killed mid-write
    _truncate_metrics(p, 2)
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_only_complete_checkpoints_count(tmp_path):
    from minirl.disk.store import complete_checkpoints

    ck = tmp_path / "checkpoints"
    for name, done in (("step_000001", True), ("step_000002", True), ("step_000003.tmp", True),
                       ("step_000000.del", True), ("step_000004", False)):
        (ck / name).mkdir(parents=True)
        if done:
            (ck / name / "minirl.json").write_text("{}")
    assert [c.name for c in complete_checkpoints(tmp_path)] == ["step_000001", "step_000002"]


def test_a_resume_rolls_back_to_the_newest_good_checkpoint_not_the_one_it_resumed_from(tmp_path):
    """#80: a run preempted in the middle of a collapse (its newest checkpoint saved with a bad streak
    pending: not good) resumed with that checkpoint as its rollback target, and `prune` kept it in
    place of the real last good one. The target is the newest good one at or before it; a rollback
    that undid a stretch makes the checkpoints inside it no target either."""
    import json

    from minirl.disk.store import rollback_target

    ck = tmp_path / "checkpoints"
    for step, good in ((0, True), (50, True), (100, True), (150, False)):
        (ck / f"step_{step:06d}").mkdir(parents=True)
        (ck / f"step_{step:06d}" / "minirl.json").write_text(json.dumps({"step": step, "good": good}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 151)))
    assert rollback_target(ck / "step_000150").name == "step_000100"
    assert rollback_target(ck / "step_000100").name == "step_000100"  # a good one is its own
    rows = [{"step": s} for s in range(1, 151)]
    rows[119] = {"step": 120, "guard/rollback_to_step": 50}  # step 120 rolled back to 50: 100 was undone
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rollback_target(ck / "step_000150").name == "step_000050"


def test_faults_wrap_nothing_unless_asked_and_then_only_the_step_they_name(monkeypatch):
    """#83: the step has no fault branch; faults.install wraps the run's parts instead, and only
    when a MINIRL_INJECT_* variable is set (a user's run is never wrapped)."""
    import math
    from types import SimpleNamespace

    from minirl import faults

    def fresh():
        trainer = SimpleNamespace(forward_backward=lambda mb, fn, **kw: fn(), clip_grads=lambda: 1.0,
                                  fill_grads=lambda v: None)
        return SimpleNamespace(state=SimpleNamespace(step=2), world=SimpleNamespace(rank=0), trainer=trainer,
                               rollouts=SimpleNamespace(next=lambda at: ([], [])), step=lambda: "row",
                               advantages=lambda r, trains=None: r, parity=lambda: 0.01)

    for k in faults.STEP_FAULTS:
        monkeypatch.delenv(k, raising=False)
    run = fresh()
    parts = (run.step, run.advantages, run.parity, run.trainer.forward_backward, run.rollouts.next)
    faults.install(run)
    assert (run.step, run.advantages, run.parity, run.trainer.forward_backward, run.rollouts.next) == parts

    monkeypatch.setenv("MINIRL_INJECT_NAN", "parity@3,loss@4")
    monkeypatch.setenv("MINIRL_INJECT_INVERT", "5")
    run = fresh()
    faults.install(run)  # the step under way is 3
    assert math.isnan(run.parity()) and run.step() == "row"
    assert run.trainer.forward_backward(None, lambda: (torch.tensor(1.0), {}))[0] == 1.0
    run.state.step = 3
    assert run.parity() == 0.01 and torch.isnan(run.trainer.forward_backward(None, lambda: (torch.tensor(1.0), {}))[0])
    assert run.advantages(torch.tensor([1.0])).item() == 1.0
    run.state.step = 4
    assert run.advantages(torch.tensor([1.0])).item() == 0.0  # step 5 on: trained on 1 − r
