"""Every configuration tree, importable from one place: the target (`ModelConfig`, `RopeConfig`,
`ConfigError`, `replace`: model/config.py), the DFlash drafter (`DrafterConfig`: drafter/config.py) and the engine
(`EngineConfig`: engine/config.py).  Each lives beside what it configures; this module only re-exports them.
"""

from specjax.drafter.config import DrafterConfig, default_target_layer_ids
from specjax.engine.config import KV_CACHE_DTYPES, EngineConfig
from specjax.model.config import SUPPORTED_FAMILIES, ConfigError, ModelConfig, RopeConfig, replace

__all__ = ["KV_CACHE_DTYPES", "SUPPORTED_FAMILIES", "ConfigError", "DrafterConfig", "EngineConfig", "ModelConfig",
           "RopeConfig", "default_target_layer_ids", "replace"]
