"""Building a Config: preset -> TOML file -> `--set` overrides -> checks, and writing it back.

Every value enters through `override`, which coerces it to the field's declared type and checks
the field's own rules (its `Literal` choices, its `Min`/`MoreThan` bound) at once, so an error
names the field and the value that broke it. A nested table's leaves are addressed with one more
dot (`algo.correction.cap`) and written as their own TOML table (`[algo.correction]`).
`qurl.config.rules.validate` re-checks a whole tree (for trees built in code) and then the rules
that tie fields together.
"""
from __future__ import annotations

import tomllib
from dataclasses import fields, is_dataclass, replace
from functools import reduce
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from qurl.config.compat import DROPPED, RENAMED, upgrade
from qurl.config.fields import ConfigError, check_field, field_hints
from qurl.config.tree import Config

# Fields a resumed run may not change: they define the weights and their layout.
IMMUTABLE_ON_RESUME = (
    "model.base", "model.dtype", "learner.tp", "learner.dp", "learner.ep", "algo.uaq_scale",
    "rollout.group_size", "run.seed", "data.train", "deploy.ranks.distributed_optimizer",
)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Turn a TOML value or a `--set` string into the field's declared type, then check it."""
    origin = get_origin(typ)
    if origin is Annotated:
        out = _coerce(value, get_args(typ)[0], key)
        check_field(out, typ, key)
        return out
    if origin is Literal:
        choices = get_args(typ)
        if value not in choices:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(str, choices))}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value else []
        return tuple(_coerce(v, get_args(typ)[0], key) for v in value)
    if not isinstance(value, str):
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
            return value
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}")
    try:
        if typ is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return typ(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}") from None


def _value_at(tree: Any, dotted: str) -> Any:
    """The value at "section.field" (or "section.table.field") of a config tree."""
    return reduce(getattr, dotted.split("."), tree)


def _set(obj: Any, parts: list[str], value: Any, key: str, table: str) -> Any:
    """`obj` (the config table named `table`) with the leaf at `parts` set to `value`."""
    hints = field_hints(type(obj))
    name = parts[0]
    if name not in hints:
        raise ConfigError(f"{key}: unknown field of [{table}] (known: {', '.join(hints)})")
    current = getattr(obj, name)
    if is_dataclass(current):
        if len(parts) == 1:
            raise ConfigError(f"{key}: a table; set its fields "
                              f"({', '.join(f'{key}.{n}' for n in field_hints(type(current)))})")
        return replace(obj, **{name: _set(current, parts[1:], value, key, f"{table}.{name}")})
    if len(parts) > 1:
        raise ConfigError(f"{key}: {table}.{name} is a field, not a table")
    return replace(obj, **{name: _coerce(value, hints[name], key)})


def override(cfg: Config, updates: dict[str, Any]) -> Config:
    """Apply {"section.field": value} updates; unknown, renamed or dropped fields are errors."""
    sections = {f.name for f in fields(cfg)}
    for key, value in updates.items():
        if key in RENAMED:
            raise ConfigError(f"{key}: renamed to {RENAMED[key]} (docs/config.md)")
        if key in DROPPED:
            raise ConfigError(f"{key}: no longer a config field: {DROPPED[key]}")
        section, dot, rest = key.partition(".")
        if not dot or section not in sections:
            raise ConfigError(f"{key}: unknown config section (known: {', '.join(sections)})")
        cfg = replace(cfg, **{section: _set(getattr(cfg, section), rest.split("."), value, key,
                                            section)})
    return cfg


def parse_sets(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"--set {pair!r}: expected section.field=value")
        out[key.strip()] = value.strip()
    return out


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    flat: dict[str, Any] = {}

    def walk(prefix: str, values: dict[str, Any]) -> None:
        for k, v in values.items():
            if isinstance(v, dict):  # a nested table: [algo.correction]
                walk(f"{prefix}.{k}", v)
            else:
                flat[f"{prefix}.{k}"] = v

    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
        walk(section, values)
    return flat


def toml_updates(path: str | Path, *, old_names: bool = False) -> dict[str, Any]:
    """A TOML file's [section] tables as `override`'s {"section.field": value} updates.
    `old_names=True` (a run directory's own config.toml, written by an older qurl) maps the
    fields renamed since then first."""
    flat = _read_toml(path)
    return upgrade(flat, where=str(path)) if old_names else flat


def to_toml(cfg: Config) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (tuple, list)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    lines: list[str] = []

    def table(name: str, obj: Any) -> None:
        lines.append(f"[{name}]")
        nested = []
        for f in fields(obj):
            v = getattr(obj, f.name)
            if is_dataclass(v):  # TOML puts a table's sub-tables after its own keys
                nested.append((f"{name}.{f.name}", v))
            else:
                lines.append(f"{f.name} = {fmt(v)}")
        lines.append("")
        for sub, v in nested:
            table(sub, v)

    for section in fields(cfg):
        table(section.name, getattr(cfg, section.name))
    return "\n".join(lines)


def immutable_changes(old: Config, new: Config) -> list[str]:
    return [f"{k}: {_value_at(old, k)!r} -> {_value_at(new, k)!r}"
            for k in IMMUTABLE_ON_RESUME if _value_at(old, k) != _value_at(new, k)]
