"""A checkpoint made into a Hugging Face model folder with its card (`minirl export`); the push
itself is minirl.models.hub's.

May import: everything below it (top-level modules, the base rooms, rewards, train, rollout, setup, eval, run). Must not
import lab or cli.
"""
