"""One atomic write and one cache folder for every layer (vitscope.io)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vitscope import io


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    io.atomic_write_text(path, "old")

    def torn(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        io.atomic_write(path, torn)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    io.atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    for name in ("VITSCOPE_CACHE", "VITSCOPE_DATA", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert io.cache_root() == io.data_root() == tmp_path / "home" / ".cache" / "vitscope"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert io.cache_root() == tmp_path / "xdg" / "vitscope"
    monkeypatch.setenv("VITSCOPE_CACHE", str(tmp_path / "c"))
    assert io.cache_root() == io.data_root() == tmp_path / "c"
    monkeypatch.setenv("VITSCOPE_DATA", str(tmp_path / "d"))
    assert io.data_root() == tmp_path / "d" and io.cache_root() == tmp_path / "c"

    from vitscope.data import cache_dir
    from vitscope.kernels import native

    assert cache_dir("fashion_mnist") == tmp_path / "d" / "fashion_mnist"
    assert native.cache_dir() == tmp_path / "c" / "native"
