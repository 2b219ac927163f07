"""Files written whole, and where vitscope keeps what it caches. Every layer may import this module; it imports
nothing of vitscope's.

    atomic_write(path, lambda tmp: torch.save(state, tmp))   # readers see the old file or the new one
    cache_root() / "native"                                  # built kernels
    data_root() / "fashion_mnist"                            # downloaded datasets and pretrained weights

A killed process leaves at most a hidden `.NAME.*.tmp` beside the file, which `training.run_dir.clean_stale`
removes from a run folder.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

try:
    import resource
except ImportError:  # not on Windows, which has no file-size limit
    resource = None

PathLike = str | os.PathLike


def atomic_write(path: PathLike, write_fn: Callable[[str], None]) -> Path:
    """Call `write_fn(tmp_path)` on a temporary file beside `path`, fsync it, then rename it over `path`.

    The rename is atomic on POSIX and Windows, so readers see the old file or the new one, and the fsyncs
    (the file's, then its folder's) make the new one survive a power cut once this returns. If `write_fn`
    raises, the temporary file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            write_fn(tmp)
        except OSError as e:
            if e.filename is None:  # say which file, whoever raised it
                raise OSError(e.errno, e.strerror or str(e), str(path)) from e
            raise
        except Exception as e:
            failed = _failed_write(e, tmp, path)
            if failed is None:
                raise
            raise failed from e
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def _failed_write(e: Exception, tmp: str, path: Path) -> OSError | None:
    """The OSError behind a writer's own exception, or None where it is not a failed write.

    safetensors raises SafetensorError with the OS's "(os error 28)" in its text, and torch.save a RuntimeError
    ("unexpected pos ...") that names no cause at all; both are a full disk or a file past the size limit
    (`ulimit -f`), which the OS's own errors then name, so the caller handles them as any OSError."""
    code = re.search(r"os error (\d+)", str(e))
    if code:
        n = int(code.group(1))
        return OSError(n, os.strerror(n), str(path))
    if not isinstance(e, RuntimeError):
        return None
    size = os.path.getsize(tmp) if os.path.exists(tmp) else 0
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE) if resource else (-1, -1)
    if soft not in (-1, getattr(resource, "RLIM_INFINITY", -1)) and size + (1 << 16) >= soft:
        return OSError(errno.EFBIG, f"{os.strerror(errno.EFBIG)} (the file-size limit, ulimit -f, is {soft} bytes)",
                       str(path))
    if shutil.disk_usage(path.parent).free < (1 << 20):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def save_figure(fig, path: PathLike, **savefig_kw) -> Path:
    """A matplotlib figure written whole (format from the path's suffix), like every other file vitscope writes."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig_kw))


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def cache_root() -> Path:
    """`$VITSCOPE_CACHE`, else `$XDG_CACHE_HOME/vitscope`, else `~/.cache/vitscope`."""
    env = os.environ.get("VITSCOPE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vitscope"


def data_root() -> Path:
    """Where datasets and pretrained weights are downloaded: `$VITSCOPE_DATA`, else `cache_root()`."""
    env = os.environ.get("VITSCOPE_DATA")
    return Path(env).expanduser() if env else cache_root()
