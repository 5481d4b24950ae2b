"""`jdp train`'s configuration: typed, validated values, read from YAML and `section.key=value` overrides.

The public name of `jdp.run.config`, where it is implemented; import it as `jdp.config`.
"""
from jdp.run.config import (ADDED_DEFAULTS, ATTENTIONS, Config, ConfigError, DATASETS, DataConfig, HASH_EXCLUDED,
                            MODELS, MODEL_DATA, ModelConfig, OptimConfig, PLACEMENT_ONLY, ParallelConfig, SECTIONS,
                            TrainConfig, apply_overrides, config_from_dict, config_hash, field_docs, identity_hash,
                            load_config, run_identity, schedule_uses_steps, validate)

__all__ = ["ADDED_DEFAULTS", "ATTENTIONS", "Config", "ConfigError", "DATASETS", "DataConfig", "HASH_EXCLUDED",
           "MODELS", "MODEL_DATA", "ModelConfig", "OptimConfig", "PLACEMENT_ONLY", "ParallelConfig", "SECTIONS",
           "TrainConfig", "apply_overrides", "config_from_dict", "config_hash", "field_docs", "identity_hash",
           "load_config", "run_identity", "schedule_uses_steps", "validate"]
