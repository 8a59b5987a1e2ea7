"""Prompts and tasks: the sources loaded through `datasets`, the embedded synthetic tasks, reasoning-gym's,
and the contract of a multi-turn task's environment (environment.py: OpenEnv's shape, without OpenEnv)."""
