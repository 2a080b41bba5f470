"""How a config field states its own rules: bounds as `Annotated` metadata, choices as `Literal`.

`check_field` checks a field from its type alone: `Annotated[int, Min(1)]` is an int >= 1,
`Annotated[float, MoreThan(0)]` a float > 0, and a `Literal[...]` one of its values; every value
`qurl.config.load.override` sets and every leaf `qurl.config.rules.validate` walks passes it. The
aliases below are the shapes the sections use most.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from qurl.errors import InputError


class ConfigError(InputError):
    """A config value is wrong; the message names the field."""


@dataclass(frozen=True)
class Min:
    """Bound a numeric field from below, inclusive: `Annotated[int, Min(1)]` means >= 1."""
    value: float


@dataclass(frozen=True)
class MoreThan:
    """Bound a numeric field from below, exclusive: `Annotated[float, MoreThan(0)]` means > 0."""
    value: float


def field_hints(section_cls: type) -> dict[str, Any]:
    """A config table's field name -> declared type, with its `Annotated` bounds kept."""
    return get_type_hints(section_cls, include_extras=True)


def check_field(value: Any, typ: Any, key: str) -> None:
    """ConfigError (naming `key`) unless `value` keeps the rules of its declared type `typ`:
    Literal choices and Min/MoreThan bounds."""
    if get_origin(typ) is Annotated:
        base, *marks = get_args(typ)
        check_field(value, base, key)
        for m in marks:
            if isinstance(m, Min) and not value >= m.value:
                raise ConfigError(f"{key}={value!r}: must be >= {m.value:g}")
            if isinstance(m, MoreThan) and not value > m.value:
                raise ConfigError(f"{key}={value!r}: must be > {m.value:g}")
    elif get_origin(typ) is Literal and value not in get_args(typ):
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(str, get_args(typ)))}")


Positive = Annotated[int, Min(1)]
Count = Annotated[int, Min(0)]
PositiveFloat = Annotated[float, MoreThan(0)]
Precision = Literal["bf16", "int8", "fp8", "fp8_block", "w4a16"]
Backend = Literal["auto", "gloo", "nccl"]
