"""The one error type the CLI turns into a single line and exit code 2."""


class UsageError(Exception):
    """Bad input from the user: a missing workspace, a malformed recipe, an unknown option value."""


class RunIOError(Exception):
    """A run could not write its files (full disk, read-only folder). The CLI prints one line and
    exits with code 4; the newest complete checkpoint is intact and `--resume` continues from it."""
