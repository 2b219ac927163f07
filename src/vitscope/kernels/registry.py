"""One registry of vitscope's CPU kernels, and the one place that decides which of them run here.

Each entry says what a kernel is, the instruction set its C code needs, the dtypes it takes, what it stands
in for, the module that calls it, and where it stands aside for a faster path (`yields_to`). Entries with
the same name and dtype are alternatives in order of preference (attention: AMX before AVX512-BF16).
`decide()` reads the table once, against this CPU, when `vitscope.kernels.apply` swaps the fast modules
in (or on the first question asked before that), and keeps, per (name, dtype), the kernel that runs or
none. The kernel modules ask `runs`/`runnable` on each call, a dictionary lookup, instead of re-deriving the
rules; what can change between calls (torch.compile tracing, forward-mode AD, torch.func) stays in
`native.runnable`. `why_not(kernel)` says why a kernel does not run.

`disabled()` is the switch that turns them all off: inside it every fast module takes its plain module's
path, so a baseline measured inside it runs PyTorch's ops alone. Nothing is monkeypatched; each fast
module asks `enabled()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from vitscope.kernels import bf16, native

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
    Kernel("attention", "avx512", ("float32",), "softmax(q kᵀ) v, at most 256 keys", "short_attention"),
    Kernel("attention", "avx2", ("float32",), "softmax(q kᵀ) v of the qkv projection, forward and backward",
           "short_attention"),
    Kernel("attention", "amx", ("bfloat16",), "softmax(q kᵀ) v, in AMX tiles", "short_attention"),
    Kernel("attention", "avx512_bf16", ("bfloat16",), "softmax(q kᵀ) v, pair dot products", "short_attention"),
    Kernel("decode attention", "avx512_bf16", ("bfloat16",), "a decoding step's cross-attention, weights out",
           "decode_attention"),
    Kernel("decode attention", "avx2", ("float32",), "a decoding step's self- and cross-attention, weights out",
           "decode_attention"),
    Kernel("linear", None, ("bfloat16",), "nn.Linear: the bias (and in inference GELU) inside oneDNN's matmul",
           "fused_linear"),
    Kernel("linear", "avx2", ("float32",), "nn.Linear's three products on AMD CPUs without AVX-512",
           "linear_f32", "amd_avx2"),
    Kernel("linear product", "avx512_bf16", ("bfloat16",), "nn.Linear's forward and input gradient without AMX",
           "linear_bf16", "amx"),
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


def onednn_linear() -> bool:
    """Whether this torch has oneDNN's fused linear (`torch.ops.mkldnn._linear_pointwise`) switched on."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    return op is not None and torch.backends.mkldnn.is_available()


def amd() -> bool:
    """AMD CPUs with AVX2 and FMA (Zen 2 and later), where MKL's float32 products are slower than oneDNN's: a
    generic path without AVX-512, and at under half oneDNN's speed with it (a Zen 5: 105 against 250 GFLOP/s;
    docs/performance.md, "Linear layers in float32 on AMD CPUs")."""
    return native.cpu_vendor() == "AuthenticAMD" and {"avx2", "fma"} <= native.cpu_features()


def amd_without_avx512() -> bool:
    """AMD CPUs with AVX2 and FMA and no AVX-512 (Zen 2 and Zen 3, or a larger one capped by VITSCOPE_ISA),
    where MKL's float32 products take a generic path and oneDNN's linear, or vitscope's AVX2 kernels, are
    faster (docs/performance.md, "Linear layers in float32 on AMD CPUs")."""
    return amd() and "avx512f" not in native.cpu_features()


def _yields(rule: str | None) -> str | None:
    """Why a kernel with `yields_to=rule` stands aside on this CPU, or None."""
    if rule == "avx512" and native.has("avx512"):
        return "this CPU has AVX-512, where PyTorch's own 16-wide kernels run"
    if rule == "amx" and native.cpu_has_amx():
        return "this CPU has AMX, whose tiles oneDNN's matmul uses instead"
    if rule == "amd_avx2" and not (onednn_linear() and amd_without_avx512()):
        return "it runs on AMD CPUs without AVX-512 only, where MKL's float32 products are slow"
    return None


def _own_why_not(kernel: Kernel) -> str | None:
    """Why `kernel` itself cannot run here (the library, the CPU, the faster path), before the switch and
    the alternatives preferred to it."""
    if kernel.isa is None:
        return None if onednn_linear() and bf16.native_matmul("cpu") else \
            "oneDNN does not run bfloat16 natively on this CPU"
    return native.unavailable(kernel.isa) or _yields(kernel.yields_to)


_decided: tuple[tuple[Kernel, ...], dict[tuple[str, str], Kernel | None]] | None = None


def decide() -> dict[tuple[str, str], Kernel | None]:
    """Read the table against this CPU, keep per (name, dtype) the kernel that runs (the first of its
    alternatives that can), and return that. `vitscope.kernels.apply` calls it; it is cheap to call again."""
    global _decided
    chosen: dict[tuple[str, str], Kernel | None] = {}
    for kernel in KERNELS:
        for dtype in kernel.dtypes:
            if chosen.get((kernel.name, dtype)) is None:
                chosen[(kernel.name, dtype)] = kernel if _own_why_not(kernel) is None else None
    _decided = (KERNELS, chosen)
    return chosen


def _chosen() -> dict[tuple[str, str], Kernel | None]:
    if _decided is None or _decided[0] is not KERNELS:  # not decided yet, or the table was replaced
        return decide()
    return _decided[1]


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def runs(name: str, dtype: str | torch.dtype) -> Kernel | None:
    """The kernel that runs `name` for `dtype` here (None: none does), as decided once."""
    return _chosen().get((name, _DTYPES.get(dtype, dtype)))


def isa(name: str, dtype: str | torch.dtype) -> str | None:
    """The instruction set of the kernel that runs `name` for `dtype` here ("onednn" for oneDNN's), or None
    where none does. torch.compile's tracing calls it and keeps the answer as a constant of the graph."""
    kernel = runs(name, dtype)
    return None if kernel is None else kernel.isa or "onednn"


# what torch.compiler.assume_constant_result does (as native.has): the answer holds for the process
isa._dynamo_marked_constant = True  # type: ignore[attr-defined]


def runnable(name: str, dtype: str | torch.dtype, *tensors: Tensor | None) -> bool:
    """Whether a kernel runs `name` for `dtype` here and may take these tensors now: not while torch.compile
    or a jit trace records, and no forward-mode dual or torch.func-wrapped tensor among them."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # asked first: Dynamo need not trace the lookup
        return False
    kernel = runs(name, dtype)
    return kernel is not None and (kernel.isa is None or native.runnable(*tensors, isa=kernel.isa))


def why_not(kernel: Kernel) -> str | None:
    """Why `kernel` does not run here (None where it does): the switch, the library, the CPU, a faster path,
    or another kernel preferred for the same work."""
    if not enabled():
        return "turned off (vitscope.kernels.disabled)"
    own = _own_why_not(kernel)
    if own is not None:
        return own
    for dtype in kernel.dtypes:
        other = runs(kernel.name, dtype)
        if other is not None and other != kernel:
            return f"the {other.isa} {kernel.name} kernel runs {dtype} here instead"
    return None


def why_none(name: str, dtype: str | torch.dtype) -> str | None:
    """Why no kernel runs `name` for `dtype` here, or None where one does."""
    dtype = _DTYPES.get(dtype, dtype)
    if runs(name, dtype) is not None:
        return None
    kernels = [k for k in KERNELS if k.name == name and dtype in k.dtypes]
    if not kernels:
        return f"vitscope has no {name} kernel for {dtype}"
    return "; ".join(f"{k.isa or 'oneDNN'}: {_own_why_not(k)}" for k in kernels)
