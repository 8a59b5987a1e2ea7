"""`minirl` with one more tool format, `any`: whatever a turn wrote before ")" is the call (the random tiny
model writes ")" now and then, "(…)" whole seldom), so that its calls reach a test's environment.

    python -m tests.env_any_format ARGS...   (the `minirl` command's arguments)"""

from cli.main import entry
from minirl.envs import formats

formats.TOOL_FORMATS["any"] = formats.ToolFormat("", ")", "expr", tool="calc")

if __name__ == "__main__":
    entry()
