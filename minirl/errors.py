"""The one error type the CLI turns into a single line and exit code 2."""


class UsageError(Exception):
    """Bad input from the user: a missing workspace, a malformed recipe, an unknown option value."""


class RunIOError(Exception):
    """A run could not write its files (full disk, read-only folder). The CLI prints one line and
    exits with code 4; the newest complete checkpoint is intact and `--resume` continues from it."""


class EngineFault(Exception):
    """The rollout engine returned what no loss may train on (non-finite log-probs for a share of a
    step's tokens, a parity check that is not finite): the engine is broken, not the policy, so the
    guard's rollback would not help. The run stops before training on it (summary status
    "engine_fault"); the CLI prints one line naming what broke and the setting that avoids it, and
    exits with code 5. `row`: the step's metrics row, where the step's update was already applied
    (a parity fault comes after the sync), so the run's files stay one row per step."""

    def __init__(self, message: str, row: dict | None = None):
        super().__init__(message)
        self.row = row


class EnvFault(Exception):
    """Most of a step's episodes ended in the environment's own error (`env.max_error_frac`: it
    raised, hung, or could not start; its server is down): their zeros would be trained on as the
    model's, teaching it that calling a tool ends in nothing. The run stops before that step trains
    (summary status "env_fault"); the CLI prints one line naming the environment and its first
    fault, and exits with code 7."""


class GraderFault(Exception):
    """Most of a step's grades were the grader's errors (`reward.max_error_frac`): a bug in the
    grader, not a policy that answers badly (a grader scores what it cannot parse 0, it does not
    raise). The run stops before training on those zeros (summary status "grader_fault"); the CLI
    prints one line naming the grader and its first error, and exits with code 6."""
