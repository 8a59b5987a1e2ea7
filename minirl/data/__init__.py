"""Prompts and tasks: the sources loaded through `datasets`, the embedded synthetic tasks (the tools
task's calculator among them: tools.py), reasoning-gym's."""
