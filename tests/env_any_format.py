"""`minirl` with more tool formats for the random tiny model (it writes ")" now and then, "(…)" whole seldom),
so that its calls reach a test's environment: `any`, whatever a turn wrote before ")" is the argument `expr` of
`calc`; `echo`, the argument `message` of echo_env's `echo_message`; `column`, the last digit before ")" the
`column` of connect4_env's move (a text without one is sent as it is: the model's mistake); `move`, the
`direction` of TRL's 2048 example's `move`. The last three speak to OpenEnv's and TRL's own environments
(tests/data/openenv, tests/data/trl) in their own names.

    python -m tests.env_any_format ARGS...   (the `minirl` command's arguments)"""

from dataclasses import dataclass

from cli.main import entry
from minirl.envs import formats
from minirl.envs.contract import ToolCall


@dataclass(frozen=True)
class _Named(formats.ToolFormat):
    arg: str = "expr"
    digit: bool = False  # the last digit of the text, an int

    def _parse(self, inner: str) -> ToolCall:
        digits = [ch for ch in inner if ch.isdigit()]
        return ToolCall(self.tool, {self.arg: int(digits[-1]) if self.digit and digits else inner.strip()})


formats.TOOL_FORMATS["any"] = formats.ToolFormat("", ")", "expr", tool="calc")
formats.TOOL_FORMATS["echo"] = _Named("", ")", "expr", tool="echo_message", arg="message")
formats.TOOL_FORMATS["column"] = _Named("", ")", "expr", tool="connect4", arg="column", digit=True)
formats.TOOL_FORMATS["move"] = _Named("", ")", "expr", tool="move", arg="direction")

if __name__ == "__main__":
    entry()
