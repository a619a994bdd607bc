"""SAFE: Stable And Fast LLM Ensembling over causal LMs with different tokenizers."""

from .config import GenerationConfig
from .ensemble import AsyncTextStream, Ensemble, TextStream
from .errors import (
    ChatTemplateError,
    ChecksumError,
    ConfigError,
    InputError,
    InputTypeError,
    MemberError,
    ModelLoadError,
    SafeEngineError,
)
from .members import Member, ModelSpec
from .stats import EnsembleStats, GenerationResult

__all__ = [
    "AsyncTextStream",
    "ChatTemplateError",
    "ChecksumError",
    "ConfigError",
    "Ensemble",
    "EnsembleStats",
    "GenerationConfig",
    "GenerationResult",
    "InputError",
    "InputTypeError",
    "Member",
    "MemberError",
    "ModelLoadError",
    "ModelSpec",
    "SafeEngineError",
    "TextStream",
]
__version__ = "0.1.0"
