"""Sweep expansion: a RunConfig -> the list of points (one validated setting each).

Each sweep group is the cartesian product of its value lists, in the order the keys are written;
groups run one after the other. No sweep = one point (the base settings).
"""

from __future__ import annotations

import dataclasses
import itertools

from jhybrid.config.schema import SECTIONS, RunConfig, build_section


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of the sweep: the base config with `overrides` applied.

    key: a stable text id of the overrides ('offload.mode=hgca,offload.beta=0.5'), used to resume."""

    key: str
    overrides: dict
    model: object
    offload: object
    benchmark: object


def point_key(overrides: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items()) or "base"


def make_point(run: RunConfig, overrides: dict) -> Point:
    specs = {}
    for section in SECTIONS:
        values = dataclasses.asdict(getattr(run, section))
        for key, value in overrides.items():
            if key.startswith(section + "."):
                values[key.split(".", 1)[1]] = value
        specs[section] = build_section(section, values)
    return Point(key=point_key(overrides), overrides=dict(overrides), **specs)


def expand_sweep(run: RunConfig) -> list[Point]:
    """Every point of the sweep, validated; duplicate points (same key) are kept once."""
    if not run.sweep:
        return [make_point(run, {})]
    points, seen = [], set()
    for group in run.sweep:
        keys = list(group)
        for values in itertools.product(*(group[k] for k in keys)):
            point = make_point(run, dict(zip(keys, values)))
            if point.key not in seen:
                seen.add(point.key)
                points.append(point)
    return points
