"""Options more than one command shares."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from minirl.errors import UsageError
from minirl.setup.workspace import RECIPE_NAME

DEFAULT_WORKSPACE = Path("minirl-ws")
_WS_TYPE = click.Path(file_okay=False, path_type=Path)


def default_workspace() -> Path:
    """The workspace a command without one works on: ./minirl-ws, or the current folder where it is a
    workspace and ./minirl-ws is not (`cd demo && minirl status`)."""
    if not (DEFAULT_WORKSPACE / RECIPE_NAME).is_file() and Path(RECIPE_NAME).is_file():
        return Path(".")
    return DEFAULT_WORKSPACE


def workspace_argument(f, *, new: bool = False):
    """WORKSPACE the way a user gives it to any command: as the positional argument
    (`minirl status demo`) or as -w/--workspace (`minirl status -w demo`); default `default_workspace()`,
    or ./minirl-ws alone for a command that makes one (`new`: `init --force` in a workspace's folder must
    never rebuild that workspace unasked). The command receives one `workspace`; two different ones are
    refused."""

    @functools.wraps(f)
    def with_workspace(*args, workspace: Path | None = None, workspace_opt: Path | None = None, **kw):
        if workspace is not None and workspace_opt is not None and Path(workspace) != Path(workspace_opt):
            raise UsageError(f"two workspaces given: {workspace} and -w {workspace_opt}; give one")
        return f(*args, workspace=workspace or workspace_opt or (DEFAULT_WORKSPACE if new else default_workspace()),
                 **kw)

    default = "./minirl-ws" if new else "./minirl-ws, or the current folder where it is a workspace"
    option = click.option("-w", "--workspace", "workspace_opt", type=_WS_TYPE, default=None,
                          help=f"The workspace, as the WORKSPACE argument [default: {default}].")
    with_workspace = option(with_workspace)
    return click.argument("workspace", type=_WS_TYPE, required=False, default=None)(with_workspace)


new_workspace_argument = functools.partial(workspace_argument, new=True)


class _PositiveFinite(click.ParamType):
    """A number above 0 that is finite: click's FloatRange lets NaN through (every comparison with
    it is false) and infinity through without a maximum."""

    name = "number"

    def convert(self, value, param, ctx):
        import math

        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not (math.isfinite(x) and x > 0):
            self.fail(f"{value!r}: it must be a finite number above 0", param, ctx)
        return x


class _ShardSize(click.ParamType):
    """A safetensors shard size as huggingface_hub reads it ("5GB", "500MB": TB, GB, MB or KB), checked
    where it is received: a typo or a size of 0 or less would reach the export half written."""

    name = "size"

    def convert(self, value, param, ctx):
        # what save_torch_state_dict itself parses the size with (not exported; the lock pins the version)
        from huggingface_hub.serialization._base import parse_size_to_int

        if isinstance(value, int):
            return value
        try:
            size = parse_size_to_int(str(value))
        except ValueError:
            self.fail(f"{value!r}: give a size with its unit, e.g. 5GB or 500MB (TB, GB, MB, KB)", param, ctx)
        if size <= 0:
            self.fail(f"{value!r}: a shard must hold at least one byte", param, ctx)
        return size


POSITIVE_FINITE = _PositiveFinite()
SHARD_SIZE = _ShardSize()
