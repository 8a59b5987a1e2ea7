"""One RL run: the step (`loop.py`), the run's lifecycle (start, resume, stop, crash), the guard
and its rollbacks, the writer's lock, where metrics go (jsonl, TensorBoard, W&B), status, summary
and plots.

May import: the top-level modules and the base rooms (disk, models, envs, data, config), rewards, train, rollout, setup, eval. Must not import publish,
lab or cli.
"""
