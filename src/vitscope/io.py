"""Files written whole, and where vitscope keeps what it caches. Every layer may import this module; it imports
nothing of vitscope's.

    atomic_write(path, lambda tmp: torch.save(state, tmp))   # readers see the old file or the new one
    cache_root() / "native"                                  # built kernels
    data_root() / "fashion_mnist"                            # downloaded datasets and pretrained weights

A killed process leaves at most a hidden `.NAME.*.tmp` beside the file, which `training.run_dir.clean_stale`
removes from a run folder.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

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
        write_fn(tmp)
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
