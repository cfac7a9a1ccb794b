"""YAML -> RunConfig: parse, apply `--set section.key=value` overrides, validate.

    from jhybrid.config import load_config
    run = load_config("configs/smoke.yaml", overrides=["benchmark.scored_tokens=32"])
"""

from __future__ import annotations

import dataclasses

import yaml

from jhybrid.config.files import read_text
from jhybrid.config.schema import SECTIONS, ConfigError, RunConfig, allowed_keys, build_section

TOP_KEYS = ("name", "description", "model", "offload", "benchmark", "parallel", "sweep")


def parse_override(text: str) -> tuple[str, object]:
    """'offload.beta=0.5' -> ('offload.beta', 0.5); the value is read as YAML (lists allowed)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({error})") from None


def _split_key(key: str) -> tuple[str, str]:
    section, _, field = key.partition(".")
    if section not in SECTIONS or not field:
        raise ConfigError(f"unknown key '{key}'; allowed keys: {', '.join(allowed_keys())}")
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if field not in names:
        raise ConfigError(f"unknown key '{key}'; allowed keys in '{section}': "
                          + ", ".join(f"{section}.{n}" for n in names))
    return section, field


def _section(doc: dict, section: str) -> dict:
    """A section's mapping; `model: NAME` is short for `model: {name: NAME}`; anything else that
    is not a mapping is a ConfigError naming the section."""
    value = doc.get(section)
    if value is None:
        return {}
    if section == "model" and isinstance(value, str):
        return {"name": value}
    if not isinstance(value, dict):
        example = "model: {name: smollm2}" if section == "model" else f"{section}: {{key: value, ...}}"
        raise ConfigError(f"'{section}' = {value!r}: expected a mapping of keys to values, e.g. {example}")
    return dict(value)


def config_from_dict(doc, overrides: list[str] = ()) -> RunConfig:
    """Validates a parsed YAML document (plus overrides) into a RunConfig: every point of the
    sweep is built, an override of a key the sweep sets is refused, and so is an offload setting
    no point's mode reads (jhybrid.config.sweep.check_settings_used)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"a run config is a mapping with keys {', '.join(TOP_KEYS)}; got {type(doc).__name__}")
    for key in doc:
        if key not in TOP_KEYS:
            raise ConfigError(f"unknown top-level key '{key}'; allowed keys: {', '.join(TOP_KEYS)}")
    if not isinstance(doc.get("name"), str) or not doc["name"]:
        raise ConfigError("'name' is required: a string naming the results files")
    sections = {s: _section(doc, s) for s in SECTIONS}
    sweep = normalize_sweep(doc.get("sweep"))
    for text in overrides:
        key, value = parse_override(text)
        section, field = _split_key(key)
        _refuse_swept(key, sweep)
        sections[section][field] = value
    built = {s: build_section(s, sections[s]) for s in SECTIONS}
    run = RunConfig(name=doc["name"], description=str(doc.get("description", "")), sweep=sweep, **built)
    from jhybrid.config.sweep import check_settings_used, expand_sweep

    points = expand_sweep(run)  # every point must validate now, not halfway through a long run
    check_settings_used(run, points)
    return run


def _refuse_swept(key: str, sweep: tuple) -> None:
    """ConfigError for an override (--set) of a key a sweep group sets: the group's points would
    silently replace the override's value."""
    groups = [i for i, group in enumerate(sweep) if key in group]
    if groups:
        raise ConfigError(f"--set {key}: the sweep sets {key} (group {', '.join(map(str, groups))}), which "
                          "overrides --set for its points; expected a key the sweep does not set (change "
                          "the sweep's values in the config instead)")


def normalize_sweep(sweep) -> tuple:
    """A sweep is a mapping or a list of mappings 'section.key' -> value or list of values."""
    if sweep is None:
        return ()
    groups = [sweep] if isinstance(sweep, dict) else sweep
    if not isinstance(groups, list):
        raise ConfigError(f"'sweep' must be a mapping or a list of mappings, got {type(sweep).__name__}")
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            raise ConfigError(f"sweep group {i} must be a mapping of 'section.key' to values, got {group!r}")
        for key, values in group.items():
            _split_key(str(key))
            if isinstance(values, list) and not values:
                raise ConfigError(f"sweep group {i}: '{key}' has an empty list of values")
        out.append({str(k): (tuple(v) if isinstance(v, list) else (v,)) for k, v in group.items()})
    return tuple(out)


def load_config(path: str, overrides: list[str] = ()) -> RunConfig:
    """Reads and validates a YAML run config; ConfigError says what is wrong and where."""
    text = read_text(path, "expected a YAML run config", ConfigError)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as error:
        first = " ".join(str(error).split())
        raise ConfigError(f"{path}: invalid YAML: {first}") from None
    try:
        return config_from_dict(doc, overrides)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def config_to_dict(run: RunConfig) -> dict:
    """The plain-dict form written into the results JSON."""
    return {"name": run.name, "description": run.description,
            **{s: dataclasses.asdict(getattr(run, s)) for s in SECTIONS},
            "sweep": [{k: list(v) for k, v in group.items()} for group in run.sweep]}
