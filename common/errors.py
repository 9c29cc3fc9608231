"""One error boundary for every command: known failures are a one-paragraph message and a documented
exit code, anything unexpected is one line and the path of a log file that holds the traceback.

    def main(argv=None) -> int:
        return run_cli(_main, argv, prog="pipelines.cli")

Exit codes (README, Reliability):

====  ==========================================================================================
0     done
1     unexpected error: one line on stderr, the traceback in a log file (``--debug`` prints it)
2     bad input: an argument, a config key, a path or a file that does not hold what it should
3     the model or its data failed: weights that do not match their config, non-finite latents
      or losses
4     an output could not be written (disk full, permissions): nothing half-written is left
130   interrupted (Ctrl-C); 143: terminated (SIGTERM). Temporary files are removed either way
====  ==========================================================================================

Known failures are :class:`UserError` and its family, and the ``ValueError`` / ``FileNotFoundError``
the checks of :mod:`mhla` and :mod:`pipelines` raise naming the value (the project's convention). The log
of an unexpected error goes to ``$MHLA_LOG_DIR``, else ``$XDG_STATE_HOME/mhla-video/logs``, else
``~/.local/state/mhla-video/logs`` (the system's temporary folder when that cannot be written).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_INPUT = 2
EXIT_MODEL = 3
EXIT_OUTPUT = 4
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class UserError(Exception):
    """A failure the user can fix, with a message naming the value and what was expected."""

    exit_code = EXIT_BAD_INPUT


class BadInputError(UserError, ValueError):
    """An argument, config value or input file is refused (exit 2). A ``ValueError`` too, so callers that
    catch the checks' ``ValueError`` keep working."""


class ModelError(UserError, ValueError):
    """The model or its data failed: weights that do not match their config, non-finite numbers (exit 3)."""

    exit_code = EXIT_MODEL


class OutputError(UserError, OSError):
    """An output could not be written (exit 4); nothing half-written is left in its place."""

    exit_code = EXIT_OUTPUT


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that ``finally`` blocks and temporary files are cleaned up."""


# ---- checks of values that arrive as text or numbers from outside

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer (negative ones wrap)


def check_seed(seed: object, name: str = "--seed") -> int:
    """``seed`` as an int in [0, 2**63 - 1] (the range of a 64-bit random generator); BadInputError otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadInputError(f"{name} {seed!r}: expected a whole number in [0, {SEED_MAX}]")
    if not 0 <= seed <= SEED_MAX:
        raise BadInputError(f"{name} {seed}: expected a whole number in [0, {SEED_MAX}] (a 64-bit generator's range)")
    return seed


def check_text(text: object, name: str = "prompt", max_chars: int | None = None) -> str:
    """``text`` as a str that is valid Unicode (no lone surrogates: what undecodable UTF-8 bytes on a command
    line become) with no control characters (NUL, escape, ...; tab and newlines are allowed);
    BadInputError naming the first bad character otherwise."""
    if not isinstance(text, str):
        raise BadInputError(f"{name} must be text, got {type(text).__name__} {_short(text)}")
    if max_chars is not None and len(text) > max_chars:
        raise BadInputError(f"{name} has {len(text):,} characters; at most {max_chars:,} are accepted")
    for i, ch in enumerate(text):
        code = ord(ch)
        if 0xD800 <= code <= 0xDFFF:
            raise BadInputError(
                f"{name} is not valid UTF-8 (an undecodable byte at character {i}); expected UTF-8 text"
            )
        if (code < 32 and ch not in "\t\n\r") or 0x7F <= code < 0xA0:
            raise BadInputError(
                f"{name} holds the control character U+{code:04X} at character {i}; expected printable text"
            )
    return text


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- the boundary


def log_dir() -> Path:
    """Where the traceback of an unexpected error is written (see the module docstring)."""
    if os.environ.get("MHLA_LOG_DIR"):
        return Path(os.environ["MHLA_LOG_DIR"])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "mhla-video" / "logs"


def write_log(prog: str, text: str) -> Path | None:
    """Writes ``text`` to a new log file for ``prog``; returns its path (None when no folder could take it)."""
    import tempfile

    name = f"{prog.replace('.', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for folder in (log_dir(), Path(tempfile.gettempdir()) / "mhla-video-logs"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.write_text(text, encoding="utf-8", errors="backslashreplace")
            return path
        except OSError:
            continue
    return None


def describe_os_error(e: OSError) -> str:
    """An OSError as one line naming the file and the reason (ELOOP, EACCES, ENOSPC, ...)."""
    reason = e.strerror or str(e)
    if e.errno == errno.ELOOP:
        reason += " (a symbolic link loop)"
    where = f" {e.filename!r}" if e.filename else ""
    return f"{reason}:{where}".rstrip(":")


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def write_failure(e: BaseException) -> str | None:
    """Why a writer failed, when ``e`` is its report that the disk refused the data (full, quota, read-only,
    too large a file); None for any other error. Writers report it in their own ways: an ``OSError`` with its
    errno, torch's zip writer a ``RuntimeError`` ("PytorchStreamWriter failed writing file ...", or "enforce
    fail at inline_container.cc ... unexpected pos" when a write came up short), safetensors a
    ``SafetensorError`` ("I/O error: No space left on device")."""
    if isinstance(e, OSError):
        return describe_os_error(e) if e.errno in WRITE_ERRNOS else None
    text = " ".join(str(e).split())
    if type(e).__name__ == "SafetensorError" and "I/O error" in text:
        return text[text.index("I/O error") :][:200]
    if isinstance(e, RuntimeError) and "PytorchStreamWriter" in text:
        return f"torch's file writer failed ({text[:160]}; a full disk?)"
    if isinstance(e, RuntimeError) and "inline_container" in text and "unexpected pos" in text:
        return "torch's file writer wrote fewer bytes than it was given (a full disk?)"
    return None


def unpickling_reason(e: BaseException) -> tuple[bool, str]:
    """``(refused_objects, reason)`` for torch.load(weights_only=True)'s UnpicklingError: whether the file is
    a pickle of objects that weights_only refuses (``GLOBAL posix.system``: code it would run) rather than no
    torch file at all, and torch's reason without its paragraphs of advice."""
    parts = [" ".join(x.split()) for x in str(e).split("\n\n")]
    parts = [x for x in parts if x and not x.startswith(("Weights only load failed", "Check the documentation"))]
    reason = " ".join(parts).split("WeightsUnpickler error:")[-1].strip() or type(e).__name__
    return "GLOBAL" in reason, reason[:200]


def classify(e: BaseException) -> tuple[int, str] | None:
    """``(exit code, message)`` for a known failure, None for an unexpected one."""
    import pickle

    if isinstance(e, UserError):
        return e.exit_code, str(e)
    if isinstance(e, pickle.UnpicklingError):  # torch.load(weights_only=True) refusing a pickle: correct, and known
        objects, reason = unpickling_reason(e)
        what = (
            "holds objects other than tensors and numbers, which weights_only loading refuses"
            if objects
            else ("is not a readable torch file")
        )
        return EXIT_BAD_INPUT, f"a file read with torch.load {what} ({reason}); expected a file of tensors"
    if isinstance(e, FileNotFoundError):
        return EXIT_BAD_INPUT, describe_os_error(e) if e.filename else str(e)
    if isinstance(e, ValueError | UnicodeError) and not isinstance(e, UnicodeDecodeError):
        return EXIT_BAD_INPUT, str(e)
    if isinstance(e, UnicodeDecodeError):
        return EXIT_BAD_INPUT, f"a file is not valid {e.encoding} text ({e.reason} at byte {e.start})"
    why = write_failure(e)
    if why is not None:
        return EXIT_OUTPUT, f"could not write: {why}"
    if isinstance(e, OSError) and e.errno in (
        errno.EACCES,
        errno.EPERM,
        errno.ELOOP,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
    ):
        return EXIT_BAD_INPUT, describe_os_error(e)
    return None


def _say(text: str) -> None:
    """One message on stderr; characters it cannot encode (an undecodable byte of a path given on the command
    line) are shown escaped instead of failing the report itself."""
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding, "replace"), file=sys.stderr)


def _first_paragraph(message: str) -> str:
    return " ".join(message.split())


@contextmanager
def terminate_as_exception() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread, so that context managers remove
    their temporary files (only in the main thread; elsewhere it does nothing)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(f"terminated by signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None, prog: str = "") -> int:
    """Runs ``main(argv)`` behind the error boundary and returns its exit code (see the module docstring).

    ``--debug`` anywhere in ``argv`` (or ``MHLA_DEBUG=1``) is taken out and makes an unexpected error print
    its traceback instead of only logging it. ``SystemExit`` (argparse's usage errors) becomes its code.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("MHLA_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    prog = prog or getattr(main, "__module__", "mhla-video")
    try:
        with terminate_as_exception():
            code = main(args)
        return int(code or 0)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        text = str(e.code)
        _say(text if text.startswith("error:") else f"error: {text}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: no output was left half-written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("terminated: no output was left half-written", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as e:  # noqa: BLE001 - the boundary: every error ends here, as a message or a log
        known = classify(e)
        if known is not None:
            code, message = known
            _say(f"error: {_first_paragraph(message)}")
            if debug:
                traceback.print_exc()
            return code
        text = "".join(traceback.format_exception(e))
        log = write_log(prog, f"{prog} {' '.join(args)}\n\n{text}")
        first = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        where = f"the traceback is in {log}" if log else "no log file could be written"
        _say(f"error: unexpected failure ({first}); {where} (rerun with --debug to print it)")
        if debug:
            _say(text.rstrip("\n"))
        return EXIT_UNEXPECTED
