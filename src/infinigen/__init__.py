"""infinigen: long-context decoding with the KV cache in a slow tier, fetching only the
entries the next attention layer will need (InfiniGen, OSDI 2024, arXiv 2406.19707)."""

from infinigen.attachment import Attachment, attach, detach
from infinigen.cache import ContextTooLongError, InfiniGenCache
from infinigen.config import ConfigError, InfiniGenConfig
from infinigen.models import UnsupportedModelError
from infinigen.skew import SkewArtifact, SkewArtifactError

__version__ = "0.1.0"

__all__ = [
    "Attachment",
    "ConfigError",
    "ContextTooLongError",
    "InfiniGenCache",
    "InfiniGenConfig",
    "SkewArtifact",
    "SkewArtifactError",
    "UnsupportedModelError",
    "attach",
    "detach",
]
