"""The package's import graph, read from the source: no cycles, engines imported only where they
belong, and every import deferred into a function says why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minirl", "cli", "rewards")
# where each engine may be imported: vLLM in the rollout package, TorchTitan on the trainer's side
ENGINE_HOMES = {
    "vllm": ("minirl.rollout",),
    "torchtitan": ("minirl.models.titan", "minirl.train.parallel", "minirl.train.replay", "minirl.train.hf_io",
                   "minirl.train.trainer"),
}


# The folders of minirl/ as layers, lowest first (docs/contributing.md): a module imports from its
# own layer and from those its layer lists, never from above. "top" is minirl's few top-level
# modules (errors, the launcher's World, the stopwatch, fault injection), then what every process
# does as it starts and ends (proc: the collector's pace, the quick exit); below the engines' rooms
# sit the files on disk, the models and the Hub, the environments' contract and hosting, data and
# tasks, and the recipe; rewards is the graders' package, beside minirl.
LAYERS = ("top", "proc", "disk", "models", "envs", "data", "config", "rewards", "train", "rollout", "setup", "eval",
          "run", "publish", "lab", "cli")
_BASE = {"top", "proc", "disk", "models", "envs", "data", "config"}
ALLOWED = {
    "top": set(),
    "proc": {"top"},
    "disk": {"top", "proc"},
    "models": {"top", "proc", "disk"},
    "envs": {"top", "proc"},
    "data": {"top", "proc", "disk", "models", "envs"},
    "config": {"top", "proc", "disk", "models", "envs", "data"},
    "rewards": _BASE,
    "train": _BASE,
    "rollout": _BASE | {"train"},
    "setup": _BASE | {"rewards", "train"},
    "eval": _BASE | {"rewards", "train", "rollout", "setup"},
    "run": _BASE | {"rewards", "train", "rollout", "setup", "eval"},
    "publish": _BASE | {"rewards", "train", "rollout", "setup", "eval", "run"},
    "lab": _BASE | {"rewards", "train", "rollout", "setup", "eval", "run", "publish"},
    "cli": _BASE | {"rewards", "train", "rollout", "setup", "eval", "run", "publish", "lab"},
}


def modules(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path], annotations: bool = False):
    """(line, imported module names, in a function?, the source line) of every import that runs,
    and with `annotations` also those under `if TYPE_CHECKING:` (which never run, but still tie
    the two modules together)."""
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not annotations:
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                yield child.lineno, [a.name for a in child.names], in_function, lines[child.lineno - 1]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
                yield child.lineno, [n for n in names if n in known or n == child.module], in_function, \
                    lines[child.lineno - 1]
            yield from walk(child, nested)

    yield from walk(tree, False)


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """module → the package's modules it imports, for annotations too (a submodule's import runs
    its package's too)."""
    edges: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for _, names, _, _ in imports(path, known, annotations=True):
            for n in names:
                parts = n.split(".")
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    if target in known and target != name and not name.startswith(target + "."):
                        edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    assert cycles(graph(modules())) == []


def test_a_planted_cycle_is_found(tmp_path):
    pkg = tmp_path / "minirl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from minirl import b\n")
    (pkg / "b.py").write_text("def f():\n    from minirl.c import x  # deferred\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minirl import b\n"
                              "import minirl.a\nx = 1\n")
    known = modules(tmp_path, ("minirl",))
    assert cycles(graph(known)) == [["minirl.a", "minirl.b", "minirl.c"]]  # the function's import counts too
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minirl import a\nx = 1\n")
    assert cycles(graph(modules(tmp_path, ("minirl",)))) == [["minirl.a", "minirl.b", "minirl.c"]]  # an annotation's too
    (pkg / "c.py").write_text("x = 1\n")
    assert cycles(graph(modules(tmp_path, ("minirl",)))) == []


def test_engines_are_imported_only_in_their_homes():
    known = modules()
    wrong = []
    for name, path in known.items():
        for line, names, _, _ in imports(path, known):
            for engine, homes in ENGINE_HOMES.items():
                if any(n == engine or n.startswith(engine + ".") for n in names) and not name.startswith(homes):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {engine}")
    assert wrong == []


def test_every_deferred_import_of_our_own_says_why():
    """An import inside a function stays only where it defers a heavy one (torch, an engine); the
    comment on its line, or on the first line of its group, says which."""
    known = modules()
    silent = []
    for name, path in known.items():
        lines = path.read_text().splitlines()
        for line, names, in_function, text in imports(path, known):
            if not in_function or not any(n.split(".")[0] in PACKAGES for n in names):
                continue
            i = line - 1
            while i > 0 and "# deferred" not in lines[i] and lines[i - 1].strip().startswith(("from ", "import ")):
                i -= 1
            if "# deferred" not in lines[i]:
                silent.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()}")
    assert silent == []


def layer(module: str, known: dict[str, Path]) -> str:
    """The layer of a module: its folder under minirl/, "top" for minirl's own modules, else its package."""
    parts = module.split(".")
    if parts[0] != "minirl":
        return parts[0]
    if len(parts) > 2 or (len(parts) == 2 and known[module].name == "__init__.py"):
        return parts[1]
    return "top"


def upward(known: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Every import of a module from a layer its own layer does not list (deferred ones too)."""
    wrong = []
    for name, path in known.items():
        mine = layer(name, known)
        for line, names, _, _ in imports(path, known):
            for n in names:
                if n not in known or n == "minirl":
                    continue
                theirs = layer(n, known)
                if theirs != mine and theirs not in ALLOWED[mine]:
                    wrong.append(f"{path.relative_to(root)}:{line} imports {n} ({mine} may not import {theirs})")
    return wrong


def test_the_layers_are_ordered_and_every_import_keeps_to_them():
    for i, name in enumerate(LAYERS):
        assert ALLOWED[name] <= set(LAYERS[:i]), name  # a layer lists only layers below it
    assert set(ALLOWED) == set(LAYERS)
    known = modules()
    assert {layer(m, known) for m in known} == set(LAYERS)  # a new folder is placed in the order first
    assert upward(known) == []


def test_a_planted_upward_import_is_found(tmp_path):
    for folder in ("minirl", "minirl/train", "minirl/run"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "minirl" / "errors.py").write_text("")
    (tmp_path / "minirl" / "run" / "loop.py").write_text("from minirl.train import trainer\nfrom minirl import errors\n")
    (tmp_path / "minirl" / "train" / "trainer.py").write_text("def f():\n    from minirl.run.loop import g  # deferred\n")
    known = modules(tmp_path, ("minirl",))
    assert upward(known, tmp_path) == ["minirl/train/trainer.py:2 imports minirl.run.loop (train may not import run)"]
    (tmp_path / "minirl" / "errors.py").write_text("from minirl.train import trainer\n")
    assert upward(known, tmp_path)[0] == "minirl/errors.py:1 imports minirl.train (top may not import train)"


VLLM_PUBLIC = {"vllm": {"LLM", "SamplingParams"}}  # what minirl imports from vLLM's public namespace


def private_vllm_reaches(known: dict[str, Path], door: str = "minirl.rollout.vllm_internals") -> list[str]:
    """Every import of vLLM outside its public names, and every assignment to an attribute vLLM owns
    that minirl replaces (RELIED's last names), in a module other than the door."""
    from minirl.rollout.vllm_internals import RELIED

    # `forward`: every torch module has one, and train/replay.py hooks TorchTitan's routers' own
    replaced = {target.rpartition(".")[2].rpartition(":")[2] for target, _ in RELIED} - {"__name__", "forward"}
    out = []
    for name, path in known.items():
        if name == door:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                extra = {a.name for a in node.names} - VLLM_PUBLIC.get(node.module, set())
                if extra:
                    out.append(f"{name}:{node.lineno} from {node.module} import {sorted(extra)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("vllm.") for a in node.names):
                out.append(f"{name}:{node.lineno} import {node.names[0].name}")
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in replaced:
                        out.append(f"{name}:{node.lineno} replaces .{t.attr}")
    return out


def test_vllms_private_parts_are_reached_through_one_door():
    """#83: every import from vLLM beyond `LLM` and `SamplingParams`, and every vLLM method minirl
    replaces, is in rollout/vllm_internals.py, where RELIED names it and the engine checks it."""
    assert private_vllm_reaches(modules()) == []


def test_a_private_vllm_reach_outside_the_door_is_found(tmp_path):
    pkg = tmp_path / "minirl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from vllm import LLM\nfrom vllm.v1.sample.sampler import Sampler\n")
    (pkg / "b.py").write_text("def f(runner, g):\n    runner._sample = g\n")
    found = private_vllm_reaches(modules(tmp_path, ("minirl",)))
    assert [f.split(" ", 1)[1] for f in found] == ["from vllm.v1.sample.sampler import ['Sampler']", "replaces ._sample"]


def test_vllm_engines_are_built_by_the_factory_alone():
    """#65: every caller (the run, eval, export, the doctor, the engine's own process) builds its
    engine through rollout/engine.py's `make_engine`: no module but the engine's own and the
    registry names VLLMEngine."""
    import re

    built = re.compile(r"VLLMEngine\s*(\(|\.from_config)|import VLLMEngine|\bVLLMEngine\b\s*$", re.MULTILINE)
    named = sorted(m for m, path in modules().items() if built.search(path.read_text()))
    assert named == [], named  # only the factory builds one: engine_class("vllm") from minirl/config/engines.py
    assert "VLLMEngine" in (ROOT / "minirl" / "config" / "engines.py").read_text()


def test_no_module_is_over_500_lines():
    """The layout's limit (docs/contributing.md): a module that grows past it has two things in it."""
    long = {m: n for m, path in modules().items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def test_the_precision_names_are_declared_once():
    """#65: rollout.precision's names (and what each means for an engine) live in minirl/config/precisions.py;
    nothing else lists them (a line naming four of them or more is a list of its own)."""
    import re

    from minirl.config.precisions import NAMES

    quoted = re.compile("|".join(re.escape(f'"{n}"') for n in NAMES))
    lists = [f"{m}:{i}" for m, path in modules().items() if m != "minirl.config.precisions"
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if len(set(quoted.findall(line))) >= 4 and not line.lstrip().startswith(">>>")]  # a doctest shows, it declares nothing
    assert lists == []


def test_the_run_folders_files_have_one_owner():
    """#65: a checkpoint's record (minirl.json), its scores (heldout.json) and a run's summary
    (summary.json) are named, read and written in minirl/disk/store.py alone; docstrings may mention them."""
    import ast

    import re

    owned = re.compile(r"\b(minirl|heldout|summary)\.json(?!l)")  # not data/heldout.jsonl
    found = []
    for name, path in modules().items():
        if name == "minirl.disk.store":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and owned.search(node.value):
                found.append(f"{name}:{node.lineno}")
    assert found == []


def test_every_number_in_a_recipe_declares_its_range_and_every_name_its_choices():
    """#65: a field's range or choices sit with the field (recipe.number / one_of / rule), so no
    numeric field goes unchecked and no table elsewhere repeats them; the loss names are the
    objective's registry's."""
    import dataclasses

    from minirl.config.recipe import LOSS_NAMES, Recipe
    from minirl.train.objective import LOSSES

    def fields(obj, prefix=""):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            yield from fields(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else [(f"{prefix}{f.name}", f, v)]

    bare = [k for k, f, v in fields(Recipe()) if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not {"range", "rule"} & set(f.metadata)]
    assert bare == []
    assert tuple(LOSSES) == LOSS_NAMES
    assert "validator" not in (ROOT / "minirl" / "config" / "recipe.py").read_text().split('"""', 2)[2]  # no dataclass imports it


def test_minirl_keeps_at_most_six_modules_at_its_top():
    """#83: a module belongs in a room that names what it holds (disk, models, data, config, …); the
    top keeps a few small utilities every layer shares."""
    top = sorted(p.name for p in (ROOT / "minirl").glob("*.py"))
    assert len(top) <= 6, top
    assert all((ROOT / "minirl" / room / "__init__.py").read_text().startswith('"""')
               for room in ("disk", "models", "envs", "data", "config"))  # each room says what it holds


def test_the_step_is_the_algorithm_alone():
    """#83: loop.py within the layout's bar, and its step free of fault plumbing: faults.py wraps
    the engine's output, the advantages, the loss, the gradients and the parity check instead."""
    source = (ROOT / "minirl" / "run" / "loop.py").read_text()
    assert len(source.splitlines()) <= 350
    step = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "step")
    names = {n.id for n in ast.walk(step) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(step) if isinstance(n, ast.Attribute)}
    assert not {"faults", "inject", "at_step"} & names
