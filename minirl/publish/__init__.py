"""A checkpoint made into a Hugging Face model folder with its card (`minirl export`); the push
itself is minirl.hub's.

May import: everything below it (top-level modules, train, rollout, setup, eval, run). Must not
import lab or cli.
"""
