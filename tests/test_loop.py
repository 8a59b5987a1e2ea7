"""Loop plumbing that needs no engine."""

import pytest
import torch

from minirl.loop import _new_run_dir, minibatch_indices, sequence_rewards
from minirl.workspace import Workspace


def test_runs_started_in_the_same_second_get_distinct_folders(tmp_path):
    a, b, c = (_new_run_dir(tmp_path / "runs") for _ in range(3))
    assert len({a, b, c}) == 3 and all(p.is_dir() for p in (a, b, c))
    assert Workspace(tmp_path).latest_run() == c  # --resume and eval's "latest" find the newest


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
