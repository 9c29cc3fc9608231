"""Files the product writes for a user, written atomically: a temporary name in the same folder, checked
(not empty; the size a text should have; for a video, that it decodes with the frames written), flushed to
disk, renamed into place only then. A writer that fails, writes short or writes something unreadable (ffmpeg
on a full disk reports "No space left on device" but exits as if it had written), or a SIGTERM (which the
error boundary of :mod:`common.errors` turns into an exception), leaves the earlier file byte-identical,
no temporary file behind, and raises :class:`OutputError` (exit 4). Temporary names fit the file system's
name limit; an output name over it is refused before any work (:func:`check_name_fits`).

    with atomic_write("out.mp4", check=verify) as tmp:   # tmp: ".out.mp4.<pid>.tmp/out.mp4" beside it
        write_with_any_library(tmp)
    with atomic_dir("model/transformer") as tmp:
        model.save_pretrained(tmp)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import BadInputError, OutputError, describe_os_error, write_failure


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot open or sync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_file_mode() -> int:
    """The permissions ``open(path, "w")`` gives a new file: 0o666 less the process's umask (0o644 under the
    usual 022)."""
    try:  # Linux states it; reading it there changes nothing
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def normalize_modes(path: str | Path) -> None:
    """Gives ``path`` (a file, or every file under a folder) the permissions a plain new file gets
    (:func:`default_file_mode`): some writers create theirs private (safetensors writes 0600), which would leave
    a model's weights unreadable to the group and others who can read the rest of the output."""
    path = Path(path)
    mode = default_file_mode()
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file() and not f.is_symlink()]
    for f in files:
        if f.stat().st_mode & 0o777 != mode:
            os.chmod(f, mode)


DEFAULT_NAME_MAX = 255  # bytes in one name: ext4, xfs, btrfs, tmpfs


def name_max(folder: str | Path) -> int:
    """The longest name (in bytes) the file system of ``folder`` (or of its nearest existing ancestor) takes."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return DEFAULT_NAME_MAX


def check_name_fits(path: str | Path) -> Path:
    """BadInputError, before any work, when ``path``'s file name is longer than its file system takes."""
    path = Path(path)
    size, limit = len(os.fsencode(path.name)), name_max(path.parent)
    if size > limit:
        raise BadInputError(
            f"output name {_shorten(path.name)!r} is {size} bytes long; the file system of {str(path.parent)!r} "
            f"takes names of at most {limit} bytes"
        )
    return path


def _shorten(name: str, keep: int = 40) -> str:
    return name if len(name) <= 2 * keep + 3 else f"{name[:keep]}...{name[-keep:]}"


def _temp_name(path: Path, kind: str) -> Path:
    """A hidden name beside ``path`` for its temporary file or folder (``kind``: "tmp", "old"), unique to this
    process and short enough for the file system: ``path``'s name is cut to make room for the tag."""
    tag = f".{os.getpid()}.{kind}"
    budget = name_max(path.parent) - 1 - len(tag.encode())  # 1: the leading dot
    stem = path.name
    while len(os.fsencode(stem)) > budget:
        stem = stem[:-1]
    return path.with_name(f".{stem}{tag}")


def _free_space(folder: Path) -> str:
    try:
        st = os.statvfs(folder)
    except OSError:
        return "unknown"
    free = st.f_bavail * st.f_frsize
    return f"{free / 2**20:.1f} MiB" if free >= 2**20 else f"{free / 1024:.0f} KiB"


@contextlib.contextmanager
def atomic_write(
    path: str | Path,
    allow_empty: bool = False,
    size: int | None = None,
    check: Callable[[Path], str | None] | None = None,
) -> Iterator[Path]:
    """Yields a temporary path to write ``path``'s content to (same name and suffix, in a private folder beside
    ``path``); on success checks that a file was written (not empty unless ``allow_empty``; of ``size`` bytes
    when given; ``check(tmp)`` returns None, else why the file is not what was written), flushes it to disk and
    renames it onto ``path``. On any failure the private folder is removed, ``path`` is untouched, and the
    failure propagates (a writer that produced no file, or a file that fails its check, raises
    :class:`OutputError`, exit 4). The folder, not just the file, goes: a writer process still finishing
    (ffmpeg) cannot recreate its file in it."""
    path = check_name_fits(path)
    folder = ensure_output_folder(path.parent)
    private = folder / _temp_name(path, "tmp").name
    _remove(private)
    try:
        private.mkdir()
    except OSError as e:
        raise OutputError(f"could not write {str(path)!r}: {describe_os_error(e)}; nothing was written") from e
    tmp = private / path.name
    try:
        yield tmp
        if not tmp.is_file() or (not allow_empty and tmp.stat().st_size == 0):
            raise OutputError(
                f"writing {str(path)!r} failed: the writer produced no file ({_free_space(folder)} free there); "
                "nothing was written"
            )
        written = tmp.stat().st_size
        why = f"{written} bytes were written of {size}" if size is not None and written != size else None
        if why is None and check is not None:
            why = check(tmp)
        if why is not None:
            raise OutputError(
                f"writing {str(path)!r} failed: {why} (a short or failed write; {_free_space(folder)} free there); "
                + ("the earlier file is left as it was" if path.exists() else "nothing was written")
            )
        normalize_modes(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(folder)
    except OSError as e:
        if isinstance(e, OutputError):
            raise
        raise OutputError(f"could not write {str(path)!r}: {describe_os_error(e)}; nothing was written") from e
    except Exception as e:
        why = write_failure(e)  # a writer's own report of a full disk (torch's zip writer, safetensors)
        if why is None:
            raise
        raise OutputError(f"could not write {str(path)!r}: {why}; nothing was written") from e
    finally:
        _remove(private)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``Path(path).write_text(text)`` in UTF-8, atomically and checked to have its full size on disk."""
    data = text.encode("utf-8")
    with atomic_write(path, allow_empty=True, size=len(data)) as tmp:
        tmp.write_bytes(data)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yields a temporary folder beside ``path``; on success renames it onto ``path`` (an earlier folder there is
    moved aside first and removed after, so there is never a moment without one); on failure removes it."""
    path = check_name_fits(path)
    parent = ensure_output_folder(path.parent)
    tmp = parent / _temp_name(path, "tmp").name
    old = parent / _temp_name(path, "old").name
    _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        normalize_modes(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_file(f)
        if path.exists():
            _remove(old)
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
        _fsync_dir(parent)
    except OSError as e:
        _remove(tmp)
        if isinstance(e, OutputError):
            raise
        raise OutputError(f"could not write {str(path)!r}: {describe_os_error(e)}; nothing was written") from e
    except Exception as e:
        _remove(tmp)
        why = write_failure(e)  # a writer's own report of a full disk (torch's zip writer, safetensors)
        if why is None:
            raise
        raise OutputError(f"could not write {str(path)!r}: {why}; nothing was written") from e
    except BaseException:
        _remove(tmp)
        raise


def check_replaceable(path: str | Path, patterns: tuple[str, ...]) -> None:
    """BadInputError unless ``path`` is absent, an empty folder, or a folder holding only files matching
    ``patterns`` (an earlier save of the same kind, which :func:`atomic_dir` may replace)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise BadInputError(f"output {str(path)!r} is a file; expected a folder to save into")
    if path.is_dir():
        others = sorted(p.name for p in path.iterdir() if not any(p.is_file() and p.match(pt) for pt in patterns))
        if others:
            raise BadInputError(
                f"output folder {str(path)!r} holds other files ({', '.join(others[:4])}); expected an empty folder "
                f"or an earlier save ({', '.join(patterns)}), which is replaced whole"
            )


def _remove(p: Path) -> None:
    with contextlib.suppress(OSError):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def resolve_output_folder(folder: str | Path) -> Path:
    """``folder`` resolved (symbolic links followed) and checked, without creating anything: BadInputError
    for a symlink loop (ELOOP), a file on the way, or a path too long."""
    folder = Path(folder)
    try:
        resolved = folder.resolve(strict=False)
        ancestor = resolved
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        ancestor.stat()
    except RuntimeError:  # Path.resolve reports a loop this way on older Pythons
        raise BadInputError(f"output folder {str(folder)!r} cannot be used: a symbolic link loop") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadInputError(f"output folder {str(folder)!r} cannot be used: a symbolic link loop") from None
        raise BadInputError(f"output folder {str(folder)!r} cannot be used: {describe_os_error(e)}") from None
    if not ancestor.is_dir():
        raise BadInputError(f"output folder {str(folder)!r} cannot be made: {str(ancestor)!r} is a file, not a folder")
    return resolved


def ensure_output_folder(folder: str | Path) -> Path:
    """Makes ``folder`` (checked as :func:`resolve_output_folder`); returns it."""
    folder = Path(folder)
    resolve_output_folder(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"could not make the output folder {str(folder)!r}: {describe_os_error(e)}") from e
    return folder


def replace_dir(src: Path, dst: Path) -> None:
    """Puts the complete folder ``src`` at ``dst`` without a moment with neither: an existing ``dst`` is renamed
    to ``.<name>.old``, ``src`` renamed into place, then the old one removed (a crash between the two renames
    leaves it at ``.<name>.old``)."""
    import os
    import shutil

    src, dst = Path(src), Path(dst)
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.with_name(f".{dst.name}.old")
    if old.exists():
        shutil.rmtree(old)
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old)
