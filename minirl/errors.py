"""The one error type the CLI turns into a single line and exit code 2."""


class UsageError(Exception):
    """Bad input from the user: a missing workspace, a malformed recipe, an unknown option value."""
