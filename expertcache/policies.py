"""Miss policies: for one MoE call (one token at one layer), which routed experts run,
which misses are fetched now, which are substituted by which resident expert, and what
is admitted in the background. The engine, the emulation and the simulator share them.

A policy is selected by a spec string, `name` or `name:key=value,key=value`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .errors import UnknownName


@dataclass
class Route:
    """The router's verdict for one token at one layer."""
    layer: int
    experts: np.ndarray  # [k] expert ids in rank order (rank 0 = first choice)
    weights: np.ndarray  # [k] gate weights, normalised as the family does
    probs: np.ndarray  # [E] the full softmax row


@dataclass
class Decision:
    experts: list[int]  # executed experts, aligned with weights
    weights: list[float]
    fetch: list[int]  # executed experts to make resident before compute (synchronous)
    admit: list[int] = field(default_factory=list)  # experts to admit in the background
    substituted: int = 0  # routed experts replaced or dropped
    substituted_mass: float = 0.0  # their summed gate weight


class CacheView(Protocol):
    def is_resident(self, layer: int, expert: int) -> bool: ...
    def in_flight(self, layer: int, expert: int) -> bool: ...
    def resident_mask(self, layer: int) -> np.ndarray: ...


class MissPolicy:
    """Base: fetch every miss. Output identical to the full model."""
    name = "fetch-all"
    exact = True

    def decide(self, route: Route, cache: CacheView) -> Decision:
        experts = route.experts.tolist()
        fetch = [e for e in experts if not cache.is_resident(route.layer, e)]
        return Decision(experts, route.weights.tolist(), fetch)

    def reset(self) -> None:
        """Forget state carried between calls (start of a run)."""

    def __repr__(self) -> str:
        return self.name


POLICIES: dict[str, type[MissPolicy]] = {"fetch-all": MissPolicy}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UnknownName(f"policy parameter {item!r} in {spec!r} is not key=value; e.g. threshold:tau=0.15")
        params[key.strip()] = value.strip()
    return name.strip(), params


def make_policy(spec: str) -> MissPolicy:
    name, params = parse_spec(spec)
    if name not in POLICIES:
        raise UnknownName(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    try:
        return cls(**{k: float(v) for k, v in params.items()})
    except (TypeError, ValueError) as e:
        raise UnknownName(f"bad parameters for policy {name!r} ({e}); see `expertcache --help`") from None
