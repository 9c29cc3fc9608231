"""Property-style checks of an entry point's error boundary (issue 30): a table of malformed values fed to
``main(argv)`` must each end with a non-zero exit code, a message and no traceback on stderr, and every file
that existed under the output path before must be byte-identical (none deleted or changed) afterwards."""

from __future__ import annotations

import os
from pathlib import Path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (symbolic links not followed) -> its bytes."""
    found = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                found[str(path.relative_to(folder))] = path.read_bytes()
    return found


def assert_refused(main, argv: list[str], capsys, folder: Path) -> str:
    """Runs ``main(argv)``; asserts the boundary's contract and returns what it printed on stderr."""
    before = snapshot(folder)
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert code not in (0, None), f"{argv}: exit code {code}, expected a refusal\n{captured.out[-1500:]}\n{err[-1500:]}"
    assert "Traceback" not in err, f"{argv}: a traceback on stderr:\n{err[-3000:]}"
    assert "error" in err.lower(), f"{argv}: no message on stderr:\n{captured.out[-1500:]}"
    after = snapshot(folder)
    changed = [name for name, data in before.items() if after.get(name) != data]
    assert not changed, f"{argv}: pre-existing files changed or deleted: {changed}"
    return err
