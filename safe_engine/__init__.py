"""SAFE: Stable And Fast LLM Ensembling over causal LMs with different tokenizers.

The layers, each importing only from those listed before it (tests/unit/test_layers.py checks it):

    errors, presets, config, stats, knobs   what every layer shares: errors, settings, results
    runtime/     members (model + tokenizer + KV cache), vocabularies, packed forwards, loading, Ray
    shaping/     chat templates, tools, grammars, the Request and its Reply
    algorithm/   alignment → aggregation → decision → the decoding round
    engine/      the scheduler and the Ensemble facade
    cli/, server/, bench, eval/    the doors and the benchmark tooling
"""

from .config import GenerationConfig
from .engine.ensemble import AsyncTextStream, Ensemble, TextStream
from .errors import (
    ChatTemplateError,
    ChecksumError,
    ConfigError,
    GenerationTimeout,
    InputError,
    InputTypeError,
    MemberError,
    ModelLoadError,
    SafeEngineError,
    ToolCallError,
)
from .runtime.members import Member, ModelSpec
from .shaping.reply import StreamEvent
from .shaping.request import Request, build_request
from .stats import EnsemblePoint, EnsembleStats, GenerationResult

__all__ = [
    "AsyncTextStream",
    "ChatTemplateError",
    "ChecksumError",
    "ConfigError",
    "Ensemble",
    "EnsemblePoint",
    "EnsembleStats",
    "GenerationConfig",
    "GenerationResult",
    "GenerationTimeout",
    "InputError",
    "InputTypeError",
    "Member",
    "MemberError",
    "ModelLoadError",
    "ModelSpec",
    "Request",
    "SafeEngineError",
    "StreamEvent",
    "TextStream",
    "ToolCallError",
    "build_request",
]
__version__ = "0.1.0"
