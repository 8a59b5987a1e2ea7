"""Prompts and tasks: the sources loaded through `datasets` and the embedded synthetic tasks."""
