"""Run configs: the YAML schema (`schema`), loading with overrides (`loading`), sweeps (`sweep`)."""

from jhybrid.config.loading import config_to_dict, load_config, parse_override
from jhybrid.config.schema import ConfigError, RunConfig, allowed_keys
from jhybrid.config.sweep import Point, expand_sweep

__all__ = ["ConfigError", "RunConfig", "Point", "allowed_keys", "config_to_dict", "expand_sweep",
           "load_config", "parse_override"]
