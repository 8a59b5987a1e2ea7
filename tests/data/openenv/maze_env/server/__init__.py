# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Maze Env environment server components."""

from .maze_env_environment import MazeEnvironment

__all__ = ["MazeEnvironment"]
