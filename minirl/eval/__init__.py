"""Evaluation: avg@k / pass@k / maj@k of a checkpoint on a benchmark (named ones through
`datasets`, local files), with vLLM sampling and the graders scoring.

May import: the top-level modules and the base rooms (disk, models, envs, data, config), rewards, train, rollout, setup. Must not import run, publish,
lab or cli (the run's periodic held-out score calls in here, not the reverse).
"""
