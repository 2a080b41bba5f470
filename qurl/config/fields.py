"""How a config field states its own rules: bounds as `Annotated` metadata, choices as `Literal`.

`qurl.config.load` checks every field from its type alone: `Annotated[int, Min(1)]` is an int
>= 1, `Annotated[float, MoreThan(0)]` a float > 0, and a `Literal[...]` one of its values. The
aliases below are the shapes the sections use most.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal


@dataclass(frozen=True)
class Min:
    """Bound a numeric field from below, inclusive: `Annotated[int, Min(1)]` means >= 1."""
    value: float


@dataclass(frozen=True)
class MoreThan:
    """Bound a numeric field from below, exclusive: `Annotated[float, MoreThan(0)]` means > 0."""
    value: float


Positive = Annotated[int, Min(1)]
Count = Annotated[int, Min(0)]
PositiveFloat = Annotated[float, MoreThan(0)]
Precision = Literal["bf16", "int8", "fp8", "fp8_block", "w4a16"]
Backend = Literal["auto", "gloo", "nccl"]
