"""Whether a device multiplies bfloat16 matrices natively, or only by emulation.

On CUDA GPUs with bfloat16 support, and on CPUs where oneDNN runs bfloat16 (AVX-512 CPUs, fastest
with AVX512-BF16 or AMX), a bfloat16 matmul is as fast as a float32 one or faster. On other CPUs
(AVX2 only: AMD before Zen 4, most Intel desktop and laptop parts) PyTorch falls back to a generic
loop, several times slower than float32 (docs/performance.md, "CPUs without AVX-512"). There, training
stays in float32 and code that needs bfloat16 results computes them in float32 and rounds.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cpu_native() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def native_matmul(device: torch.device | str = "cpu") -> bool:
    """True where bfloat16 matmuls on `device` run in a native kernel (not PyTorch's generic fallback)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_native()
    return False  # other devices: not measured, so training stays in float32 unless asked (--amp bf16)
