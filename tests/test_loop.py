"""Loop plumbing that needs no engine."""

from minirl.loop import _new_run_dir
from minirl.workspace import Workspace


def test_runs_started_in_the_same_second_get_distinct_folders(tmp_path):
    a, b, c = (_new_run_dir(tmp_path / "runs") for _ in range(3))
    assert len({a, b, c}) == 3 and all(p.is_dir() for p in (a, b, c))
    assert Workspace(tmp_path).latest_run() == c  # --resume and eval's "latest" find the newest
