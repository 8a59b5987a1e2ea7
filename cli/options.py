"""Options more than one command shares."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from minirl.errors import UsageError

DEFAULT_WORKSPACE = Path("minirl-ws")
_WS_TYPE = click.Path(file_okay=False, path_type=Path)


def workspace_argument(f):
    """WORKSPACE the way a user gives it to any command: as the positional argument
    (`minirl status demo`) or as -w/--workspace (`minirl status -w demo`); default ./minirl-ws.
    The command receives one `workspace`; two different ones are refused."""

    @functools.wraps(f)
    def with_workspace(*args, workspace: Path | None = None, workspace_opt: Path | None = None, **kw):
        if workspace is not None and workspace_opt is not None and Path(workspace) != Path(workspace_opt):
            raise UsageError(f"two workspaces given: {workspace} and -w {workspace_opt}; give one")
        return f(*args, workspace=workspace or workspace_opt or DEFAULT_WORKSPACE, **kw)

    with_workspace = click.option("-w", "--workspace", "workspace_opt", type=_WS_TYPE, default=None,
                                  help="The workspace, as the WORKSPACE argument [default: ./minirl-ws].")(with_workspace)
    return click.argument("workspace", type=_WS_TYPE, required=False, default=None)(with_workspace)
