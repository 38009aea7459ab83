"""Every user-facing configuration, as typed dataclasses, and the YAML loader that checks them.

`loader` turns YAML and `key=value` overrides into these classes (unknown keys and wrong types are
errors naming the key); `pool` holds the pool's and the client's settings, `job` the training
job's. This package imports nothing else of eagle_ray, so any module may depend on it.
"""

from eagle_ray.config.job import (
    DataConfig,
    DraftSpec,
    EvalConfig,
    JobConfig,
    RegenerateConfig,
    TrainConfig,
)
from eagle_ray.config.loader import (
    ConfigError,
    apply_overrides,
    flatten,
    from_dict,
    load_yaml,
    to_dict,
)
from eagle_ray.config.pool import ClientConfig, PoolConfig

__all__ = ["ClientConfig", "ConfigError", "DataConfig", "DraftSpec", "EvalConfig", "JobConfig",
           "PoolConfig", "RegenerateConfig", "TrainConfig", "apply_overrides", "flatten",
           "from_dict", "load_yaml", "to_dict"]
