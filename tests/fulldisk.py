"""A full disk and a read-only folder for tests (issues 39, 53). A full disk: a small tmpfs mounted in the test's
folder (root on Linux), filled up to a chosen number of free bytes. A read-only folder: a tmpfs remounted read-only
(root), or the folder's modes (others). Where no tmpfs can be mounted the test is skipped with the reason; tests that
need only a writer's short write simulate it instead (see their docstrings)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class FullDisk:
    """A mounted tmpfs at ``root``; :meth:`fill` leaves ``free`` bytes, :meth:`release` frees them again."""

    def __init__(self, root: Path):
        self.root = root
        self.filler = root / ".filler"

    def fill(self, free: int = 0) -> None:
        """Writes a filler file until the disk refuses (ENOSPC), then gives back ``free`` bytes."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            block = b"\1" * 4096
            while True:
                try:
                    os.write(fd, block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(block) == 1:
                        break
                    block = block[: len(block) // 2]
        finally:
            os.close(fd)
        size = self.filler.stat().st_size
        os.truncate(self.filler, max(0, size - free))

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def files(self) -> list[str]:
        """What is on the disk besides the filler (relative names, hidden ones too)."""
        return sorted(
            str(p.relative_to(self.root)) for p in self.root.rglob("*") if p != self.filler and p.name != "lost+found"
        )


@contextlib.contextmanager
def full_disk(folder: Path, size: str = "2m") -> Iterator[FullDisk]:
    """A ``size`` tmpfs mounted at ``folder`` (made if missing) for the ``with`` block; skips the test when it
    cannot be mounted (not root, no mount(8), a container without the capability)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a tmpfs, and mounting one needs root (simulated in the other tests)")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
        )
    except OSError as e:
        pytest.skip(f"no mount(8) to make a full disk: {e}")
    if done.returncode != 0:
        pytest.skip(f"a tmpfs could not be mounted for a full disk: {done.stderr.strip()}")
    try:
        yield FullDisk(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@contextlib.contextmanager
def read_only(folder: Path, files: dict[str, bytes] | None = None) -> Iterator[Path]:
    """``folder`` (made if missing) holding ``files`` (relative name: bytes), then read-only for the ``with``
    block: a tmpfs remounted read-only as root (root writes through file modes: EROFS stops it), the folder's
    modes otherwise (0o555: EACCES). Skips the test when root cannot mount one."""
    folder.mkdir(parents=True, exist_ok=True)

    def fill() -> None:
        for name, data in (files or {}).items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)

    if os.geteuid() != 0:
        fill()
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(0o555)
        try:
            yield folder
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True, text=True
        )
    except OSError as e:
        pytest.skip(f"no mount(8) to make a read-only folder as root: {e}")
    if done.returncode != 0:
        pytest.skip(f"a tmpfs could not be mounted for a read-only folder: {done.stderr.strip()}")
    try:
        fill()
        done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"the tmpfs could not be made read-only: {done.stderr.strip()}")
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
