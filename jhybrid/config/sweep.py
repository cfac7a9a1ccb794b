"""Sweep expansion: a RunConfig -> the list of points (one validated setting each).

Each sweep group is the cartesian product of its value lists, in the order the keys are written;
groups run one after the other. No sweep = one point (the base settings).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from jhybrid.config.schema import SECTIONS, ConfigError, RunConfig, build_section

log = logging.getLogger("jhybrid.config")


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of the sweep: the base config with `overrides` applied.

    key: a stable text id of the overrides ('offload.mode=hgca,offload.beta=0.5'), used to resume."""

    key: str
    overrides: dict
    model: object
    offload: object
    benchmark: object
    parallel: object


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


def check_settings_used(run: RunConfig, points: list[Point]) -> None:
    """Offload settings given but never read (OffloadConfig.ignored_settings). A setting applies
    to the points of the sweep group that sets it, or to every point when the base section (or
    --set) gives it. When none of those points' modes reads it: a ConfigError, as `jhybrid generate`
    refuses a flag its --mode does not use, if their mode is the base section's; a warning naming
    it if their modes come from the sweep (a group is a cartesian product, and one base section is
    often shared by configs sweeping different modes, e.g. configs/throughput-h100*.yaml)."""
    by_key = {point.key: point for point in points}
    for i, group in enumerate(run.sweep):
        keys = list(group)
        members = [by_key[point_key(dict(zip(keys, values)))]
                   for values in itertools.product(*(group[k] for k in keys))]
        for key in keys:
            if key.startswith("offload.") and key != "offload.mode":
                _check_read(key, group[key] if len(group[key]) > 1 else group[key][0], members,
                            f"sweep group {i}: ")
    base = run.offload  # the base section as given (with --set)
    for f in dataclasses.fields(base):
        if f.name != "mode" and getattr(base, f.name) != f.default:
            _check_read(f"offload.{f.name}", getattr(base, f.name),
                        [p for p in points if f"offload.{f.name}" not in p.overrides], "")


def _check_read(key: str, value, points: list[Point], where: str) -> None:
    """ConfigError or warning (check_settings_used) when no point of `points` reads `key`."""
    name = key.split(".", 1)[1]
    if not points or any(name not in point.offload.ignored_settings() for point in points):
        return
    modes = ", ".join(sorted({point.offload.mode for point in points}))
    message = f"{where}'{key}' = {value!r} is not read by offload.mode {modes}"
    if all("offload.mode" not in point.overrides for point in points):
        raise ConfigError(f"{message}; expected only settings that mode reads")
    log.warning("%s: ignored", message)

