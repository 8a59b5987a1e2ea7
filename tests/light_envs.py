"""Environments for the tests that host them in processes of their own (env.isolation = "process"): this
module imports nothing heavy, so a worker's process starts in a fraction of a second."""

from __future__ import annotations

import os
import time

from minirl.envs.contract import Observation as Obs  # light: the worker's process imports it anyway


class Crashes:
    """Its step kills its process ("9") or hangs (anything else)."""

    def reset(self):
        pass

    def step(self, action):
        if action.arguments["expr"] == "9":
            os._exit(9)
        time.sleep(30)


class Fine:
    def reset(self):
        pass

    def step(self, action):
        return Obs(result="=1;")
