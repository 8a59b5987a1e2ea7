"""Verifiable-reward graders. A grader maps (problem record, response text) to a Score.

The built-ins are registered in rewards/base.py; third-party graders are found through the
`minirl.graders` entry-point group, so `pip install some-package` adds graders without touching minirl.
"""

from rewards.base import Grader, Score, load_grader

__all__ = ["Grader", "Score", "load_grader"]
