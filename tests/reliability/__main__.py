"""``python -m tests.reliability``: the fault-injection probes (:data:`tests.reliability.PROBES`) alone, as one
suite, and their table. Exit 0 only when every probe passed or was skipped with its reason and none is missing.

    python -m tests.reliability                    # every probe (the slow ones too: tens of minutes on a 2-core CPU)
                                                   # (the soak: 100 requests; MHLA_SOAK_REQUESTS=N for another)
    python -m tests.reliability --tier fast        # the fast ones (what tests/reliability/test_suite.py runs)
    python -m tests.reliability --markdown benchmarks/results/reliability.md -- -x   # pytest's options after --
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

TIERS = {"fast": "reliability and not slow", "slow": "reliability and slow", "all": "reliability"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__.splitlines()[0])
    p.add_argument("--tier", choices=list(TIERS), default="all", help="which probes: fast, slow or all (default)")
    p.add_argument("--json", type=Path, default=None, help="write the rows (probe, test, result, seconds, why) here")
    p.add_argument("--markdown", type=Path, default=None, help="write the table here")
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = p.parse_args(argv)

    import pytest

    from tests.reliability import FULL_SOAK, OUT_ENV, ROOT, SOAK_ENV, files, ok, table

    out = args.json or Path(tempfile.mkstemp(prefix="reliability-", suffix=".json")[1])
    os.environ[OUT_ENV] = str(out)
    os.environ.setdefault(SOAK_ENV, str(FULL_SOAK))  # the full soak here (pytest -m slow runs a shorter one)
    present = [f for f in files() if (ROOT / f).is_file()]
    os.chdir(ROOT)
    code = pytest.main([*present, "-m", TIERS[args.tier], "-p", "no:cacheprovider", "-q", *args.pytest_args])
    rows = json.loads(out.read_text()) if out.is_file() and out.stat().st_size else []
    if args.json is None:
        out.unlink(missing_ok=True)
    text = table(rows)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"# Reliability probes ({args.tier})\n\n```\n{text}\n```\n")
    if not rows:
        print("no probe ran", file=sys.stderr)
        return 1
    return 0 if all(ok(r) for r in rows) and code in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
