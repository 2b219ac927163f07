"""One registry of vitscope's CPU kernels: what each is, the instruction set it needs, what it stands in
for, whether it can run here, and the one switch that turns them all off.

`disabled()` is that switch: inside it every fast module takes its plain module's path, so a baseline
measured inside it runs PyTorch's ops alone. Nothing is monkeypatched; each fast module asks `enabled()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

_DISABLED = 0  # how many `disabled()` blocks are open (a plain int: torch.compile guards it as a constant)


def enabled() -> bool:
    """Whether the fast modules may run vitscope's kernels now (no `disabled()` block is open)."""
    return _DISABLED == 0


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Everything inside runs PyTorch's own ops where vitscope would run its kernels."""
    global _DISABLED
    _DISABLED += 1
    try:
        yield
    finally:
        _DISABLED -= 1


@dataclass(frozen=True)
class Kernel:
    """A kernel: its name, the instruction set its C code is built for (None: oneDNN's, through PyTorch),
    the dtypes it takes, what it stands in for, and the module that calls it."""

    name: str
    isa: str | None
    dtypes: tuple[str, ...]
    stands_in_for: str
    module: str
    # Where it stands aside for a faster path: "avx512" (PyTorch's 16-wide kernels), "amx" (oneDNN's tiles),
    # "amd_avx2" (it runs only on AMD CPUs without AVX-512, where MKL's float32 products are slow)
    yields_to: str | None = None


KERNELS: tuple[Kernel, ...] = (
    Kernel("attention", "avx2", ("float32",), "softmax(q kᵀ) v of the qkv projection, forward and backward",
           "short_attention"),
    Kernel("attention", "avx512", ("float32",), "softmax(q kᵀ) v, at most 256 keys", "short_attention"),
    Kernel("attention", "avx512_bf16", ("bfloat16",), "softmax(q kᵀ) v, pair dot products", "short_attention"),
    Kernel("attention", "amx", ("bfloat16",), "softmax(q kᵀ) v, in AMX tiles", "short_attention"),
    Kernel("linear", None, ("bfloat16",), "nn.Linear: the bias (and in inference GELU) inside oneDNN's matmul",
           "fused_linear"),
    Kernel("linear", "avx2", ("float32",), "nn.Linear's three products on AMD CPUs without AVX-512",
           "linear_f32", "amd_avx2"),
    Kernel("linear", "avx512_bf16", ("bfloat16",), "nn.Linear's forward and input gradient without AMX",
           "linear_kernel", "amx"),
    Kernel("linear weight gradient", "avx512_bf16", ("bfloat16",), "gᵀ x of small linear layers without AMX",
           "fused_linear", "amx"),
    Kernel("gelu", "avx2", ("float32",), "nn.GELU (exact) without AVX-512", "fused_gelu", "avx512"),
    Kernel("gelu", "avx512_bf16", ("bfloat16",), "nn.GELU (exact), from a table, derivative kept", "fused_gelu"),
    Kernel("mlp", "avx512_bf16", ("bfloat16",), "fc1 -> GELU -> fc2 in training, GELU's derivative kept",
           "fused_mlp"),
    Kernel("mlp", "avx2", ("float32",), "fc1 -> GELU -> fc2 in training, GELU's derivative kept", "fused_mlp",
           "amd_avx2"),
    Kernel("layer norm", "avx512_bf16", ("bfloat16",), "nn.LayerNorm, then autocast's cast to bfloat16",
           "fused_layer_norm"),
    Kernel("residual add", "avx512_bf16", ("bfloat16",), "x + branch, a float32 stream and a bfloat16 branch",
           "fused_residual"),
    Kernel("residual add + layer norm", "avx512_bf16", ("bfloat16",), "x + branch, then the next LayerNorm",
           "fused_add_norm"),
    Kernel("batch norm + gelu", "avx2", ("float32",), "the conv stem's BatchNorm2d -> GELU", "fused_bn_gelu",
           "avx512"),
    Kernel("batch norm + gelu", "avx512_bf16", ("bfloat16",), "the conv stem's BatchNorm2d -> GELU",
           "fused_bn_gelu"),
    Kernel("conv weight gradient", "avx2", ("float32",), "the conv stem's 3x3 weight gradients", "fused_conv",
           "amd_avx2"),
    Kernel("conv weight gradient", "avx512_bf16", ("bfloat16",), "the conv stem's 3x3 weight gradients",
           "fused_conv", "amx"),
)
