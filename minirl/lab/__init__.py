"""The lab: studies that test the paper's findings on this machine (`minirl lab STUDY`), the
runner that runs each arm as a `minirl run` of its own, the stages a command declares and runs
(staging: the first, a confirmation, a follow-up), their statistics (verdicts), rescoring
at another precision, and the doctor (`minirl doctor`: the training–inference mismatch of one
checkpoint, measured).

May import: everything in minirl. Nothing in minirl imports it; cli does.
"""
