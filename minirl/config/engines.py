"""The rollout engines minirl can build, by the name `rollout.engine` gives: each a class that
implements rollout/engine.py's contract, named as "module:class" and imported only when an engine
is built (vLLM is heavy). A second engine is one module and one line here; the validator takes
`rollout.engine`'s choices from this table."""

ENGINES = {"vllm": "minirl.rollout.vllm:VLLMEngine"}
