"""The one config tree of qurl: frozen dataclasses, presets as Python functions, TOML + `--set` overrides.

A run is fully described by a `Config` (tree.py: eight training sections, then `sglang` and
`deploy` from deployment.py, every field typed and documented, its bounds from fields.py). It is built from a preset (`cpu-tiny` by default,
presets.py), then a TOML file (`--config f.toml`, same section names), then `--set a.b=c`
overrides, and checked (load.py, rules.py) with errors that name the field. The resolved tree is
written to the run directory as `config.toml` and read back on resume (compat.py reads files
written before the redesign), where fields in `IMMUTABLE_ON_RESUME` must not change.
"""
from qurl.config.deployment import (AlarmDeployConfig, RanksDeployConfig, StreamDeployConfig,
                                    SyncDeployConfig)
from qurl.config.fields import ConfigError
from qurl.config.load import (IMMUTABLE_ON_RESUME, immutable_changes, override, parse_sets, to_toml,
                              toml_updates)
from qurl.config.presets import PRESETS, load_config
from qurl.config.rules import validate
from qurl.config.tree import (DEPLOYMENT_SECTIONS, LOCAL_BASES, TRAINING_SECTIONS, AlgoConfig,
                              Config, CorrectionConfig, DataConfig, DeployConfig, EvalConfig,
                              LearnerConfig, ModelConfig, OptimConfig, RolloutConfig, RunConfig,
                              SGLangConfig, field_doc, leaves)

__all__ = [
    "IMMUTABLE_ON_RESUME", "PRESETS", "DEPLOYMENT_SECTIONS", "LOCAL_BASES", "TRAINING_SECTIONS",
    "AlarmDeployConfig", "RanksDeployConfig", "StreamDeployConfig", "SyncDeployConfig",
    "AlgoConfig", "Config", "ConfigError", "CorrectionConfig", "DataConfig", "DeployConfig",
    "EvalConfig", "LearnerConfig", "ModelConfig", "OptimConfig", "RolloutConfig", "RunConfig",
    "SGLangConfig", "field_doc", "immutable_changes", "leaves", "toml_updates",
    "load_config", "override", "parse_sets", "to_toml", "validate",
]
