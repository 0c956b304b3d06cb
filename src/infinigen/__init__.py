"""infinigen: long-context decoding with the KV cache in a slow tier, fetching only the
entries the next attention layer will need (InfiniGen, OSDI 2024, arXiv 2406.19707).

Public API: `InfiniGenConfig`, `attach` (a context manager that returns a `Session`),
`InfiniGenCache` (from `session.new_cache()`, for `model.generate(past_key_values=...)`)
and `cache.summary()`.
"""

from infinigen.api import attach
from infinigen.attach import Session
from infinigen.cache import CacheClosedError, ContextTooLongError, InfiniGenCache
from infinigen.config import POLICIES, ConfigError, InfiniGenConfig
from infinigen.generate_guard import UnsupportedGenerationError
from infinigen.models import UnsupportedModelError
from infinigen.skew import SkewArtifact, SkewArtifactError

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "CacheClosedError",
    "ConfigError",
    "ContextTooLongError",
    "InfiniGenCache",
    "InfiniGenConfig",
    "Session",
    "SkewArtifact",
    "SkewArtifactError",
    "UnsupportedGenerationError",
    "UnsupportedModelError",
    "attach",
]
