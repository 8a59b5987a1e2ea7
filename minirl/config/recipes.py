"""Recipe files: a Recipe read from TOML and `--set a.b=c` flags, and the recipes shipped in recipes/.

Precedence: dataclass defaults < recipe TOML < `--set` flags. An unknown section or key fails and
names it; a value of the wrong type fails and names the key; then each field's own range
(recipe.check_fields) and the rules across fields (validator.validate). Nothing is rewritten.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from minirl.config.recipe import Recipe, check_fields
from minirl.config.validator import validate
from minirl.errors import UsageError


def _coerce(key: str, typ: Any, value: Any, *, flag: bool) -> Any:
    """Check (a TOML value: typed as TOML types it, #75) or parse (`flag`: a `--set` string) one
    value against its declared type."""
    typ = typing.get_origin(typ) or typ
    from_flag = flag and isinstance(value, str) and typ is not str
    try:
        if typ is bool:
            if from_flag:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError
            return value
        if typ is int:
            if isinstance(value, bool) or (not from_flag and not isinstance(value, int)):
                raise ValueError
            return int(value)
        if typ is float:  # a TOML float or integer; from a flag, a number's text
            if isinstance(value, bool) or not (from_flag or isinstance(value, (int, float))):
                raise ValueError
            return float(value)
        if typ is dict:
            v = json.loads(value) if from_flag else value
            if not isinstance(v, dict):
                raise ValueError
            return v
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (ValueError, TypeError):
        pass
    else:
        return value
    hint = ""
    if not flag and isinstance(value, str) and typ in (int, float):
        hint = f" (a TOML string: write {value.strip()} without quotes)"
    if from_flag and typ is bool:
        hint = " (true or false)"
    if from_flag and typ is dict:  # a flag's table is JSON, not TOML's inline table
        hint = (f" (a flag's table is a JSON object: --set '{key}={{\"name\": \"value\"}}', double-quoted keys and "
                "strings)")
    what = type(value).__name__ if not isinstance(value, (str, int, float, bool, dict, list)) else None
    raise UsageError(f"{key}: expected {getattr(typ, '__name__', typ)}, got {value!r}"
                     + (f" (a TOML {what})" if what else "") + hint)


def _apply(recipe: Recipe, section: str, key: str, value: Any, *, flag: bool) -> None:
    sections = {f.name: f for f in dataclasses.fields(Recipe)}
    if section not in sections:
        raise UsageError(f"unknown recipe section [{section}]; known: {', '.join(sections)}")
    obj = getattr(recipe, section)
    hints = typing.get_type_hints(type(obj))
    if section == "rollout" and key in ("dtype", "fp8"):
        raise UsageError(f"rollout.{key} was replaced by rollout.precision = \"fp32\" | \"bf16\" | \"fp8\" "
                         "(dtype \"bfloat16\" → \"bf16\", \"float32\" → \"fp32\", fp8 = true → \"fp8\")")
    if section == "rollout" and key == "overlap":
        raise UsageError("rollout.overlap was replaced by rollout.max_staleness (overlap = true → max_staleness = 1, "
                         "false → 0; docs/async.md)")
    head, dot, rest = key.partition(".")
    if dot and head in hints and dataclasses.is_dataclass(getattr(obj, head)):  # `--set train.lora.rank=16`
        _apply_fields(getattr(obj, head), f"{section}.{head}", {rest: value}, flag=flag)
        return
    if key not in hints:
        raise UsageError(f"unknown recipe key {section}.{key}; known in [{section}]: {', '.join(hints)}")
    if dataclasses.is_dataclass(getattr(obj, key)):  # a [section.sub] table
        if not isinstance(value, dict):
            raise UsageError(f"{section}.{key} is a table: [{section}.{key}] in a recipe, or --set {section}.{key}.KEY=VALUE")
        _apply_fields(getattr(obj, key), f"{section}.{key}", value, flag=flag)
        return
    setattr(obj, key, _coerce(f"{section}.{key}", hints[key], value, flag=flag))


def _apply_fields(obj, where: str, values: dict[str, Any], *, flag: bool) -> None:
    """Keys of a subsection ([train.lora]) onto its dataclass."""
    hints = typing.get_type_hints(type(obj))
    for key, value in values.items():
        if key not in hints:
            raise UsageError(f"unknown recipe key {where}.{key}; known in [{where}]: {', '.join(hints)}")
        setattr(obj, key, _coerce(f"{where}.{key}", hints[key], value, flag=flag))


def load(path: Path | None, overrides: list[str] = ()) -> Recipe:
    """defaults < TOML file < `section.key=value` overrides."""
    recipe = Recipe()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"recipe not found: {path}")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # TOML is UTF-8: say where the byte that is not stands
            line = raw[: e.start].count(b"\n") + 1
            raise UsageError(f"malformed recipe {path}: line {line} holds the byte {raw[e.start:e.start + 1]!r}, "
                             "which is not UTF-8 (TOML files are UTF-8): re-save it as UTF-8") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"malformed recipe {path}: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise UsageError(f"{path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _apply(recipe, section, key, value, flag=False)
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot or not key:
            raise UsageError(f"--set expects section.key=value, got {item!r}")
        _apply(recipe, section, key.strip(), value.strip(), flag=True)
    check_fields(recipe)
    validate(recipe)
    return recipe


def with_sets(recipe: Recipe, sets: dict[str, Any]) -> Recipe:
    """A validated copy of `recipe` with `{"section.key": value}` changes (as `--set` gives them)."""
    out = copy.deepcopy(recipe)
    for dotted, value in sets.items():
        section, _, key = dotted.partition(".")
        _apply(out, section, key, value, flag=True)
    check_fields(out)
    validate(out)
    return out


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def for_model(model_id: str | None) -> Path | None:
    """The shipped recipe written for a model (recipes/<id, lower case>.toml), if there is one."""
    if not model_id:
        return None
    p = RECIPES_DIR / f"{model_id.lower()}.toml"
    return p if p.is_file() else None


def shipped(name: str) -> Path:
    """A recipe from `recipes/` by file stem, e.g. "tiny"."""
    p = RECIPES_DIR / f"{name}.toml"
    if not p.is_file():
        names = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.toml")))
        raise UsageError(f"no shipped recipe {name!r}; available: {names}")
    return p
