"""A run folder is used by one training run at a time: an OS file lock held for the life of the run.

``fcntl.flock`` on ``<run_dir>/.lock``, ``run_dir`` taken by its resolved path (a symbolic link to the folder
is the same run; a link to a folder not made yet makes it): the kernel releases it when the process ends in any way (exit, crash,
SIGKILL), so a lock is never stale for the kernel; the file records the holder's PID, host and start time,
so a second run is refused with a message naming the holder, and a run that finds the file of a dead
holder says that it takes over a stale lock. Only the main process of a distributed run takes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.errors import BadInputError, describe_os_error
from common.outputs import resolve_output_folder
from training.checkpoint import LOCK_FILE


class RunLockedError(BadInputError):
    """Another run holds the run folder."""


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir`` exclusively (see the module docstring). ``stale`` is the
    record of a dead holder whose lock file was found (None otherwise)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.stale: dict[str, Any] | None = None

    @property
    def folder(self) -> Path:
        """The run folder by its resolved path (symbolic links followed): an alias is the same run, and a link
        to a folder not made yet leads to it."""
        return resolve_output_folder(self.run_dir)

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def _named(self) -> str:
        folder = self.folder
        alias = f" (that is {str(folder)!r})" if folder != self.run_dir.absolute() else ""
        return f"run_dir {str(self.run_dir)!r}{alias}"

    def acquire(self) -> RunLock:
        folder = self.folder  # a symlink loop or a file on the way: refused here
        if folder.exists() and not folder.is_dir():
            raise BadInputError(f"{self._named()} is a file; expected a folder for the run")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise BadInputError(f"{self._named()} cannot be used: {describe_os_error(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            host = f" on {holder['host']}" if holder.get("host") else ""
            since = f", since {holder['started']}" if holder.get("started") else ""
            raise RunLockedError(
                f"{self._named()} is in use by PID {holder.get('pid', '?')} (another training run{host}{since}); "
                f"wait for it to end, stop it, or choose another run_dir (the lock is {str(folder / LOCK_FILE)!r}, "
                "released when that process exits)"
            ) from None
        previous = _read(fd)
        # we hold the flock, so whoever the file names is gone (the kernel drops a dead process's lock)
        self.stale = previous if previous.get("pid") else None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # no holder recorded: the next run sees no stale record
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        record = json.loads(data) if data else {}
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def is_main_launch() -> bool:
    """True in a single process and in the rank-0 process of torchrun / accelerate launch (read from the
    environment, before accelerate starts)."""
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def hold_run_dir(run_dir: str | Path) -> Iterator[RunLock | None]:
    """Holds ``run_dir``'s lock for the ``with`` block in the main process (other ranks: nothing); says so when
    it takes over the stale lock of a process that died."""
    if not is_main_launch():
        yield None
        return
    with RunLock(run_dir) as lock:
        if lock.stale:
            print(
                f"note: {str(lock.path)!r} named PID {lock.stale.get('pid')}, which no longer holds it (the run "
                "stopped without releasing it); taking it over",
                file=sys.stderr,
            )
        yield lock
