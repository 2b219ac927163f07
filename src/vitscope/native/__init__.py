"""vitscope's C kernels: built on first use with the system C compiler, cached, loaded with ctypes.

Nothing here is needed for vitscope to work: where there is no compiler, the CPU lacks the
instructions a kernel needs, or `VITSCOPE_NATIVE=0` is set, `library()` returns None and callers
keep their PyTorch path. `why_not()` says which of these it was.

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

from vitscope.fused_linear import _transformed

_HERE = Path(__file__).resolve().parent
_LOCK = threading.Lock()

# The instructions the kernels use; the flags name them for the compiler, and
# /proc/cpuinfo must list every one of the features before the library is loaded.
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=gnu11", "-mfma", "-mavx512f", "-mavx512bw",
         "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
CPU_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16")

_reason: str | None = None


def cache_dir() -> Path:
    """Where built libraries go."""
    env = os.environ.get("VITSCOPE_CACHE")
    if env:
        return Path(env).expanduser() / "native"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vitscope" / "native"


def cpu_features() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


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


def build(sources: list[Path], name: str, *, cc: str | None = None, out_dir: Path | None = None) -> Path:
    """Compile `sources` (and the headers beside them) into one shared library called `name`, or find the
    one already built, and return its path. Raises RuntimeError with the compiler's message when the
    build fails."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    folders = sorted({s.parent for s in sources})
    inputs = sorted({*sources, *(h for f in folders for h in f.glob("*.h"))})
    text = b"".join(p.name.encode() + p.read_bytes() for p in inputs)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(text + repr((cc, version, FLAGS)).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{name}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        includes = [f"-I{f}" for f in folders]
        done = subprocess.run([cc, *FLAGS, *includes, "-o", tmp, *map(str, sources), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            names = ", ".join(s.name for s in sources)
            raise RuntimeError(f"{Path(cc).name} could not build {names}:\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _unavailable() -> str | None:
    if os.environ.get("VITSCOPE_NATIVE", "1").strip().lower() in ("0", "no", "off", "false"):
        return "switched off by VITSCOPE_NATIVE=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are for Linux on x86-64, not {platform.system()} on {platform.machine()}"
    missing = [f for f in CPU_FEATURES if f not in cpu_features()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
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
    if lib.vs_amx_init() != 0:
        _reason = "the kernel refused AMX to this process (arch_prctl ARCH_REQ_XCOMP_PERM failed)"
        return None
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.vs_attention_fwd.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, p, f32, i32]
    lib.vs_attention_fwd.restype = i32
    lib.vs_attention_bwd.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, p, f32, i32]
    lib.vs_attention_bwd.restype = i32
    lib.vs_gelu_fwd.argtypes = [p, p, p, i64, i32]
    lib.vs_gelu_fwd.restype = None
    lib.vs_layer_norm_fwd.argtypes = [p, p, p, p, p, p, i64, i64, f32, i32]
    lib.vs_layer_norm_fwd.restype = None
    lib.vs_layer_norm_bwd.argtypes = [p, p, p, p, p, p, p, i64, i64, i32]
    lib.vs_layer_norm_bwd.restype = None
    lib.vs_add_bf16.argtypes = [p, p, p, i64, i32]
    lib.vs_add_bf16.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (see `why_not`)."""
    with _LOCK:
        return _load()


def runnable(*tensors) -> bool:
    """Whether the kernels may run on these tensors now: the library loaded, and no torch.compile or
    jit trace recording, and none of them a forward-mode dual or torch.func-wrapped tensor (the
    kernels' autograd functions have no rules for those, and their data pointers are not the
    values). None entries are skipped."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if any(_transformed(t) for t in tensors if t is not None):
        return False
    return library() is not None


def why_not() -> str | None:
    """Why `library()` is None; None when it loaded."""
    library()
    return _reason
