"""Runs a pytest selection many times in a row, each run in a fresh process with fresh random draws, and
records every run: how a flaky test is found before it blocks a landing (issue 39: "the suite must pass 20
runs in a row").

    python -m tests.repeat --runs 20 -- -m "not slow" tests/mhla            # the random-input tests
    python -m tests.repeat --runs 20 --out benchmarks/results/repeat.json -- -m "not slow"   # the fast suite

Each run is ``python -m pytest -q -p no:cacheprovider <args>`` with a JUnit report; the record (``--out``,
written atomically after every run, so a stopped sweep keeps what it ran) holds each run's counts, seconds
and failures, with the ``MHLA_TEST_SEED=...`` line a failing test printed (``tests/conftest.py``'s ``gen``),
so a failure can be replayed. It stops at the first failing run unless ``--keep-going``. Exit 0 when every
run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from common.outputs import write_text_atomic

SEED = re.compile(r"MHLA_TEST_SEED=(\d+)")


def read_junit(path: Path) -> dict:
    """Counts and failures of one pytest JUnit report: ``{"passed", "failed", "skipped", "failures": [{"test",
    "message", "seed"}]}`` (errors count as failures)."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            out = " ".join((e.text or "") for e in case.iter() if e.tag in ("system-out", "failure", "error"))
            seed = SEED.search(out)
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            message = (bad.get("message") or "").strip().splitlines()
            failures.append({"test": test, "message": message[0][:300] if message else "", "seed": seed and seed[1]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def run_once(pytest_args: list[str], env: dict | None = None) -> dict:
    """One pytest run in a fresh process: its counts, failures, exit code and seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "junit_logging=system-out",
            f"--junitxml={report}",
            *pytest_args,
        ]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seconds = time.perf_counter() - start
        result = read_junit(report) if report.is_file() else {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    result.update(returncode=done.returncode, seconds=round(seconds, 1))
    if done.returncode not in (0, 5) and not result["failures"]:  # no report of what failed: keep pytest's tail
        result["failures"].append({"test": "(pytest)", "message": done.stdout[-2000:], "seed": None})
    return result


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def repeat(pytest_args: list[str], runs: int, keep_going: bool = False, out: Path | None = None) -> dict:
    """Runs the selection up to ``runs`` times; the record (also written to ``out`` after each run)."""
    record = {
        "what": "pytest runs in a row, each a fresh process with fresh random draws",
        "pytest_args": pytest_args,
        "commit": _commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "runs_asked": runs,
        "runs": [],
    }
    for i in range(runs):
        result = run_once(pytest_args)
        record["runs"].append(result)
        ok = result["returncode"] in (0, 5) and not result["failures"]
        line = f"run {i + 1}/{runs}: {result['passed']} passed, {result['failed']} failed in {result['seconds']} s"
        print(line + ("" if ok else " <- " + "; ".join(f"{f['test']} (seed {f['seed']})" for f in result["failures"])))
        record["passed_in_a_row"] = next(
            (j for j, r in enumerate(record["runs"]) if r["failures"] or r["returncode"] not in (0, 5)),
            len(record["runs"]),
        )
        if out is not None:
            write_text_atomic(out, json.dumps(record, indent=1) + "\n")
        if not ok and not keep_going:
            break
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m tests.repeat", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="how many runs in a row (default 20)")
    p.add_argument("--keep-going", action="store_true", help="run them all even after a failing run")
    p.add_argument("--out", type=Path, default=None, help="JSON record, rewritten after every run")
    args = p.parse_args(ours)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    record = repeat(pytest_args, args.runs, args.keep_going, args.out)
    n, asked = record["passed_in_a_row"], args.runs
    print(f"{n} of {asked} runs passed in a row" + (f" (record: {args.out})" if args.out else ""))
    return 0 if n == asked else 1


if __name__ == "__main__":
    sys.exit(main())
