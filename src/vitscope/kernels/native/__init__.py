"""vitscope's C kernels: built on first use with the system C compiler, cached, loaded with ctypes.

Nothing here is needed for vitscope to work: where there is no compiler, the CPU lacks the
instructions a kernel needs, or `VITSCOPE_NATIVE=0` is set, callers keep their PyTorch path.

Each source is compiled for its own instruction set (`SOURCES`): one build of the float32 attention for
AVX2 with FMA (every x86-64 CPU since about 2013-2015: AMD before Zen 4, Intel's desktop and laptop
parts), the other for AVX-512 alone (any AVX-512 CPU: Intel since Skylake-SP, AMD since Zen 4), the
bfloat16 GELU, LayerNorm and residual kernels and one build of the bfloat16 attention for AVX-512 with
its bfloat16 extension (AMD since Zen 4, Intel since Cooper Lake), the other build of the bfloat16
attention for AMX. The library loads where the CPU has the first; `has(isa)` says whether a kernel of
that set may run, and `unavailable(isa)` why not.

A build goes to `$VITSCOPE_CACHE/native` (else `$XDG_CACHE_HOME/vitscope/native`, else
`~/.cache/vitscope/native`), named by a hash of the source, the compiler and its flags, so an edited
source or another compiler builds afresh. It is compiled to a temporary file in that folder and
renamed into place, so two processes building at once, or a killed build, never leave a half-written
library behind. The libraries link OpenMP dynamically; torch has already loaded its libgomp, so the
kernels and torch share one runtime and thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from vitscope.io import atomic_write, cache_root

_HERE = Path(__file__).resolve().parent
_LOCK = threading.Lock()

# The instruction sets: each one's compiler flags, and the CPU features (/proc/cpuinfo's names) a kernel
# compiled with them needs. Each builds on the one before it.
_BASE_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_BASE_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")
ISAS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "avx2": (["-mavx2", "-mfma"], ("avx2", "fma")),
    "avx512": (_BASE_FLAGS, _BASE_FEATURES),
    "avx512_bf16": ([*_BASE_FLAGS, "-mavx512bf16"], (*_BASE_FEATURES, "avx512_bf16")),
    "amx": ([*_BASE_FLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
            (*_BASE_FEATURES, "avx512_bf16", "amx_tile", "amx_bf16")),
}
# Which instruction set each source is compiled for (another source: the base set).
SOURCES = {"attention_bf16.c": "avx512_bf16", "attention_f32.c": "avx512", "attention_f32_avx2.c": "avx2",
           "batch_norm.c": "avx512_bf16", "batch_norm_f32_avx2.c": "avx2",
           "conv_weight_grad.c": "avx512_bf16",
           "conv_weight_grad_f32_avx2.c": "avx2", "decode_attention.c": "avx512_bf16",
           "decode_attention_f32_avx2.c": "avx2", "gelu.c": "avx512_bf16",
           "gelu_f32_avx2.c": "avx2", "layer_norm.c": "avx512_bf16", "linear.c": "avx512_bf16",
           "linear_f32_avx2.c": "avx2",
           "residual.c": "avx512_bf16", "short_attention.c": "amx", "weight_grad.c": "avx512_bf16"}
# Functions and loops start on 32-byte boundaries. GCC's generic tuning aligns loops to 16 bytes at most,
# so where a product's inner loop started, relative to the 32- and 64-byte windows the core fetches and
# caches its decoded instructions in, moved with every change to any source before it in the library, and
# the kernels' speed with it (docs/performance.md, "How the kernels are compiled").
FLAGS = ["-O3", "-fPIC", "-fopenmp", "-std=gnu11", "-falign-functions=32", "-falign-loops=32"]

_reason: str | None = None
_isas: dict[str, str | None] = {}  # each instruction set: None where its kernels may run, else why not


def cache_dir() -> Path:
    """Where built libraries go."""
    return cache_root() / "native"


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first processor's `field` in /proc/cpuinfo (empty where there is none), read once: a read costs
    0.1-0.6 ms, which a question asked on every call would pay many times a step."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip()
    return ""


def isa_cap() -> str | None:
    """The highest instruction set `VITSCOPE_ISA` lets the kernels use (a key of ISAS), or None for no cap.

    Capping lets an AVX-512 or AMX machine run, and so test, the kernels written for a smaller set. A value
    that names no set caps nothing here; `unavailable()` then says the kernels are off and why."""
    cap = os.environ.get("VITSCOPE_ISA", "").strip().lower()
    return cap if cap in ISAS else None


def bad_isa_cap() -> str | None:
    cap = os.environ.get("VITSCOPE_ISA", "").strip()
    if cap and cap.lower() not in ISAS:
        return f"VITSCOPE_ISA={cap!r} names no instruction set: use one of {', '.join(ISAS)}, or unset it"
    return None


def cpu_features() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere), less those of the instruction sets
    above `VITSCOPE_ISA`, so that every choice made from them sees the capped CPU."""
    flags = set(_cpuinfo("flags").split())
    cap = isa_cap()
    if cap is None:
        return flags
    allowed = {f for isa in list(ISAS)[: list(ISAS).index(cap) + 1] for f in ISAS[isa][1]}
    return flags - ({f for _, features in ISAS.values() for f in features} - allowed)


def cpu_has_amx() -> bool:
    """Whether the CPU (as capped) multiplies bfloat16 in AMX tiles, where oneDNN outruns vitscope's kernels."""
    return "amx_bf16" in cpu_features()


def supported_isas() -> list[str]:
    """The instruction sets of ISAS this CPU has, smallest first, whatever `VITSCOPE_ISA` says."""
    flags = set(_cpuinfo("flags").split())
    return [isa for isa, (_, features) in ISAS.items() if set(features) <= flags]


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it ("GenuineIntel", "AuthenticAMD"; empty elsewhere)."""
    return _cpuinfo("vendor_id")


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else cc, gcc or clang on the PATH."""
    env = os.environ.get("CC")
    if env:
        return shutil.which(env)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _flags(version: list[str]) -> list[str]:
    """FLAGS for the compiler whose `--version` begins with `version`: clang takes -falign-loops only from
    version 13, so other compilers than GCC go without it."""
    gcc = any("gcc" in line.lower() or "free software foundation" in line.lower() for line in version)
    return FLAGS if gcc else [f for f in FLAGS if not f.startswith("-falign-loops")]


def _isa_flags(source: Path) -> list[str]:
    return ISAS[SOURCES.get(source.name, "avx512")][0]


def build(sources: list[Path], name: str, *, cc: str | None = None, out_dir: Path | None = None) -> Path:
    """Compile `sources` (each for its instruction set, with the headers beside them) into one shared
    library called `name`, or find the one already built, and return its path. Raises RuntimeError with
    the compiler's message when the build fails."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    folders = sorted({s.parent for s in sources})
    inputs = sorted({*sources, *(h for f in folders for h in f.glob("*.h"))})
    text = b"".join(p.name.encode() + p.read_bytes() for p in inputs)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:2]
    common = _flags(version)
    flags = [(s.name, _isa_flags(s)) for s in sorted(sources)]
    key = hashlib.sha256(text + repr((cc, version, common, flags)).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{name}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)

    def compile_and_link(tmp: str) -> None:
        includes = [f"-I{f}" for f in folders]
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{name}-objects-") as objects:
            objs = [str(Path(objects) / f"{s.stem}.o") for s in sources]
            compiles = [subprocess.Popen([cc, *common, *_isa_flags(s), *includes, "-c", str(s), "-o", o],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                        for s, o in zip(sources, objs)]  # side by side: a second each
            failed = []
            for source, c in zip(sources, compiles):
                err = c.communicate()[1]
                if c.returncode:
                    failed.append((source.name, err))
            if not failed:
                done = subprocess.run([cc, "-shared", "-fopenmp", "-o", tmp, *objs, "-lm"], capture_output=True,
                                      text=True)
                if done.returncode:
                    failed.append((", ".join(s.name for s in sources), done.stderr))
            if failed:
                what, err = failed[0]
                raise RuntimeError(f"{Path(cc).name} could not build {what}:\n{err.strip()[-2000:]}")

    atomic_write(target, compile_and_link)  # a process killed mid-build leaves no half library to load
    return target


def _lacking(isa: str) -> str | None:
    cap = isa_cap()
    if cap is not None and list(ISAS).index(isa) > list(ISAS).index(cap):
        return f"capped at {cap} by VITSCOPE_ISA"
    missing = [f for f in ISAS[isa][1] if f not in cpu_features()]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _unavailable() -> str | None:
    if os.environ.get("VITSCOPE_NATIVE", "1").strip().lower() in ("0", "no", "off", "false"):
        return "switched off by VITSCOPE_NATIVE=0"
    if bad_isa_cap():
        return bad_isa_cap()
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are for Linux on x86-64, not {platform.system()} on {platform.machine()}"
    lacking = _lacking("avx2")
    if lacking:
        return lacking
    if compiler() is None:
        return "no C compiler found (set $CC, or install gcc)"
    return None


@functools.cache
def _load() -> ctypes.CDLL | None:
    global _reason
    _reason = _unavailable()
    if _reason is not None:
        return None
    try:
        sources = sorted(_HERE.glob("*.c"))
        try:
            path = build(sources, "vitscope_kernels")
        except OSError:  # the cache is not writable: build into a private temporary folder
            path = build(sources, "vitscope_kernels", out_dir=Path(tempfile.mkdtemp(prefix="vitscope-native-")))
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as err:
        _reason = str(err)
        return None
    _isas.update({isa: _lacking(isa) for isa in ISAS})
    if _isas["amx"] is None and lib.vs_amx_init() != 0:
        _isas["amx"] = "the kernel refused AMX to this process (arch_prctl ARCH_REQ_XCOMP_PERM failed)"
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for attention in (lib.vs_attention_fwd, lib.vs_attention_bf16_fwd, lib.vs_attention_f32_fwd,
                      lib.vs_attention_f32_avx2_fwd):
        attention.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, p, f32, i32]
        attention.restype = i32
    for attention in (lib.vs_attention_bwd, lib.vs_attention_bf16_bwd, lib.vs_attention_f32_bwd,
                      lib.vs_attention_f32_avx2_bwd):
        attention.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, p, f32, i32]
        attention.restype = i32
    lib.vs_decode_attention_bf16.argtypes = [p, i64, i64, i64, p, p, p, i64, i64, i64, i64, i64, f32, p, p, i64, i64,
                                             p, i32]
    lib.vs_decode_attention_bf16.restype = None
    lib.vs_decode_attention_f32_avx2.argtypes = [p, i64, i64, i64, p, i64, i64, i64, p, i64, i64, i64, p, i64, i64,
                                                 i64, i64, i64, f32, p, p, i64, i64, p, i32]
    lib.vs_decode_attention_f32_avx2.restype = None
    lib.vs_gelu_fwd.argtypes = [p, p, p, i64, i32]
    lib.vs_gelu_fwd.restype = None
    lib.vs_gelu.argtypes = [p, p, i64, i32]
    lib.vs_gelu.restype = None
    lib.vs_gelu_f32.argtypes = [p, p, i64, i32]
    lib.vs_gelu_f32.restype = None
    lib.vs_gelu_f32_bwd.argtypes = [p, p, p, i64, i32]
    lib.vs_gelu_f32_bwd.restype = None
    for stats, fwd, bwd in ((lib.vs_bn_stats, lib.vs_bn_gelu_fwd, lib.vs_bn_gelu_bwd),
                            (lib.vs_bn_stats_f32, lib.vs_bn_gelu_f32_fwd, lib.vs_bn_gelu_f32_bwd)):
        stats.argtypes = [p, i64, i64, p, p, p, i32]
        fwd.argtypes = [p, i64, i64, p, p, p, p, i32]
        bwd.argtypes = [p, p, p, i64, i64, p, p, p, p, p, p, p, i32]
        stats.restype = fwd.restype = bwd.restype = None
    for ln in (lib.vs_layer_norm_fwd, lib.vs_layer_norm_bf16_fwd):
        ln.argtypes = [p, p, p, p, p, p, i64, i64, f32, i32]
        ln.restype = None
    for ln in (lib.vs_layer_norm_bwd, lib.vs_layer_norm_bf16_bwd):
        ln.argtypes = [p, p, p, p, p, p, p, i64, i64, i32]
        ln.restype = None
    lib.vs_add_layer_norm_fwd.argtypes = [p, p, p, p, p, p, p, p, i64, i64, f32, i32]
    lib.vs_add_layer_norm_fwd.restype = None
    lib.vs_add_layer_norm_bwd.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i32]
    lib.vs_add_layer_norm_bwd.restype = None
    lib.vs_add_bf16.argtypes = [p, p, p, i64, i32]
    lib.vs_add_bf16.restype = None
    lib.vs_weight_grad_bf16.argtypes = [p, i64, p, i64, i64, i64, i64, p, p, p, p, i32]
    lib.vs_weight_grad_bf16.restype = i32
    lib.vs_conv_weight_grad_bf16.argtypes = [p, p, i64, i64, i64, i64, i64, i64, i64, i32, i32, i32, i32, p, p, i32]
    lib.vs_conv_weight_grad_bf16.restype = i32
    lib.vs_conv_weight_grad_f32_avx2.argtypes = [p, p, i64, i64, i64, i64, i64, i64, i64, i32, i32, i32, i32, p, p,
                                                 i32]
    lib.vs_conv_weight_grad_f32_avx2.restype = i32
    lib.vs_linear_bf16.argtypes = [p, i64, i64, i64, p, i64, i32, i64, p, p, i64, p, i64, i32, p, p, i32]
    lib.vs_linear_bf16.restype = None
    lib.vs_linear_f32_avx2.argtypes = [p, i64, i64, i64, p, i64, i32, i64, p, p, i64, p, p, i64, p, i32]
    lib.vs_linear_f32_avx2.restype = None
    lib.vs_weight_grad_f32_avx2.argtypes = [p, i64, p, i64, i64, i64, i64, p, p, p, p, i32]
    lib.vs_weight_grad_f32_avx2.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (see `unavailable`)."""
    with _LOCK:
        return _load()


def has(isa: str) -> bool:
    """Whether kernels compiled for `isa` (a key of ISAS) may run here: the library loaded and the CPU
    has the instructions. Inside torch.compile's tracing Dynamo calls it and keeps the answer as a
    constant of the graph rather than tracing into the loader (whose lock would break the graph at every
    call that asks); so a model compiled before any eager call loads the library and gets the kernels
    too. Loading once is all that can change the answer, so the constant holds for the process."""
    return library() is not None and _isas.get(isa) is None


# What torch.compiler.assume_constant_result(has) does, without importing torch._dynamo with vitscope (2.3 s
# of every `import vitscope`); tests/test_native.py checks that the decorator sets this very marker.
has._dynamo_marked_constant = True  # type: ignore[attr-defined]


def transformed(t: torch.Tensor | None) -> bool:
    """A forward-mode dual tensor or one wrapped by torch.func (vmap, grad): the kernels' autograd functions
    have no rules for those, so such calls keep PyTorch's ops."""
    if t is None:
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return True
    return torch.autograd.forward_ad.unpack_dual(t).tangent is not None


def runnable(*tensors, isa: str) -> bool:
    """Whether the kernels of `isa` may run on these tensors now, called from Python (not as a custom
    op torch.compile can keep): `has(isa)`, and no torch.compile or jit trace recording, and none of
    them a forward-mode dual or torch.func-wrapped tensor (the kernels' autograd functions have no
    rules for those, and their data pointers are not the values). None entries are skipped."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if any(transformed(t) for t in tensors if t is not None):
        return False
    return has(isa)


def unavailable(isa: str | None = None) -> str | None:
    """Why the library did not load (or, given `isa`, why that instruction set's kernels cannot run);
    None when they can."""
    if library() is None:
        return _reason
    return None if isa is None else _isas[isa]
