"""Quantized members: int8 linear layers on the CPU, transformers' quantization configs elsewhere.

Why not PyTorch's dynamic int8 as is (`quantize_dynamic`, fbgemm): it quantizes a layer's whole input with
one scale, so a row's result depends on the other rows of the forward — in a packed batch on the other
requests, in a verifier's pass on the other drafted tokens. Measured on a 896→4864 layer: a row's error grew
7× when a batch-mate had an 8× larger range. That breaks the engine's invariants (a request's answer must
not depend on its batch; two copies of one model must agree). `Int8Linear` keeps fbgemm's kernel and makes
the scale per row: each row is divided by its own max |x|, and one calibration row (-1 first, 1 last, zeros
between) pins the kernel's per-tensor range to [-1, 1], so every row is quantized the same alone or in any
batch.

Weights are int8 with one scale per output channel, embeddings int8 with one scale per token (a lookup
reads one row; a subclass such as Gemma's scaled embedding stays as loaded). On a GPU,
"int8" is transformers' bitsandbytes 8-bit config, and a transformers quantization config object is passed
through as is: both untested here (no GPU in CI).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

QUANTIZATIONS = ("int8",)


def check_quantization(quantization: Any, dtype: str | torch.dtype | None = None, device: Any = None) -> None:
    """Refuse what cannot be honoured, before any weights are read."""
    if quantization is None or _is_transformers_config(quantization):
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"unknown quantization {quantization!r}; use 'int8' (CPU: int8 weights and activations; GPU: "
            "bitsandbytes 8-bit), a transformers quantization config, or None for the loaded dtype"
        )
    on_cpu = _on_cpu(device)
    if on_cpu and dtype is not None and str(dtype).removeprefix("torch.") != "float32":
        raise ConfigError(
            f"quantization='int8' on the CPU computes in float32 around its int8 matmuls; drop dtype={dtype} "
            "(or pass dtype='float32')"
        )
    if on_cpu and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ConfigError("quantization='int8' on the CPU needs PyTorch's fbgemm kernels (x86); this build lacks them")


def loading_config(quantization: Any, device: Any) -> Any:
    """The `quantization_config` for `from_pretrained` (GPU and passed-through configs), or None."""
    if quantization is None:
        return None
    if _is_transformers_config(quantization):
        return quantization
    if _on_cpu(device):
        return None  # quantized after loading: `quantize_int8`
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


def _on_cpu(device: Any) -> bool:
    """Whether a member's device is the CPU ("auto" is, on a machine without an accelerator)."""
    if device is None or str(device) == "auto":
        return device is None or not torch.cuda.is_available()
    return torch.device(device).type == "cpu"


def _is_transformers_config(value: Any) -> bool:
    try:
        from transformers.utils.quantization_config import QuantizationConfigMixin
    except ImportError:  # pragma: no cover - transformers always has it
        return False
    return isinstance(value, QuantizationConfigMixin)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (one scale per output channel) and int8 activations (one scale per row)."""

    bias: torch.Tensor | None
    calibration: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(1).clamp_min(1e-12) / 127).double()
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13, still the fbgemm path
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        calibration = torch.zeros(1, self.in_features)
        calibration[0, 0], calibration[0, -1] = -1.0, 1.0
        self.register_buffer("calibration", calibration)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        scaled = torch.cat([rows / scale, self.calibration])
        out = torch.ops.quantized.linear_dynamic(scaled, self._packed, True)[:-1] * scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module):
    """An embedding table in int8 with one scale per token: a quarter of float32's memory, looked up exactly."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        weight = embedding.weight.detach().float()
        scale = weight.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        self.register_buffer("weight", (weight / scale).round().to(torch.int8))
        self.register_buffer("scale", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight).float() * nn.functional.embedding(ids, self.scale)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear (the output head included) and plain nn.Embedding of a CPU model, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
            elif type(child) is nn.Embedding:
                setattr(parent, name, Int8Embedding(child))
    # What stays float (norms, rotary tables) may be views of the memory-mapped checkpoint, and one view keeps
    # the whole file mapped: 2.4 GB resident for Qwen2.5-0.5B, whose pages the quantization has just read.
    for module in model.modules():
        if not isinstance(module, Int8Linear | Int8Embedding):
            for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
                tensor.data = tensor.data.clone()
    return model
