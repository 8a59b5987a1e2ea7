"""The workspace: building it (`minirl init`, the embedded task's tokenizer and cold start) and
checking what it holds before any engine starts (preflight: recipe against machine and model,
whose rules are `limits`; checkpoints, data against its grader, which run to resume), and the plan of a run (`plan`: what
`--dry-run` prints, and what a GPU run checks against its device; `footprint`: what a rank holds, by part).

May import: the top-level modules and the base rooms (disk, models, envs, data, config), rewards, train. Must not import eval, run, publish, lab or cli:
every command above reads the workspace through here.
"""
