"""Issue 53 (4): a fine-tuning run killed (SIGKILL) at twenty random moments (inside a step, inside a checkpoint
save, inside a metrics write, at the end of the run) and resumed each time with ``resume=latest`` ends as an
uninterrupted run of the same seed: the same final weights bit for bit, the same metrics rows, no half-written
file read as whole, nothing temporary left behind.

The runs are forks of one process that imported the recipe once (``tests/training/killpoints.py``): twenty-odd
runs of the tiny model take about a minute, without an interpreter and torch start-up each (about 5 s here).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "finetune" / "tiny.yaml")
STEPS, EVERY, KEEP, KILLS = 24, 3, 2, 20
END_POINTS = ("final-weights", "after-final-model", "end-row")  # in the order the end of a run passes them
SAVE_POINTS = ("rank-state", "weights", "training-state", "manifest", "renamed", "pruning", "timer")
TIMING = ("step_time", "tokens_per_s")  # the only fields of a metrics row that differ between two runs


class Server:
    """The fork server of :mod:`tests.training.killpoints`: :meth:`run` runs one job, returns its exit code."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        code = "from tests.training.killpoints import serve; serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: close() can end it with the run it forked
        )

    def run(self, argv: list[str], log: Path, journal: Path, plan: dict | None, timeout: float = 300) -> int:
        job = {"argv": argv, "log": str(log), "journal": str(journal), "plan": plan}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no answer from the run within {timeout} s; its log:\n{tail(log)}"
        return json.loads(self.proc.stdout.readline())["exit"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a run that hangs: the server and what it forked
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else "(no log)"


def plans(rng: random.Random) -> list[dict]:
    """Twenty kills at increasing absolute steps (so that each is reached by the run resumed after the one
    before), each kind at least four times, the end of the run three times."""
    while True:
        steps = sorted(rng.sample(range(STEPS + 1), KILLS - len(END_POINTS)))
        out = []
        for k in steps:
            if k == 0:
                kind = "metrics"  # the start's evaluation row: nothing else happens at step 0
            elif k % EVERY == 0 and rng.random() < 0.75:
                kind = "save"
            else:
                kind = rng.choice(["step", "metrics"])
            delay = rng.uniform(0.0, 0.15 if kind == "step" else 0.3)  # into a step of ~0.2 s, a save of ~0.3 s
            plan = {"kind": kind, "step": k, "cut": rng.random(), "delay": round(delay, 3)}
            if kind == "step":
                plan["point"] = rng.choice(["forward", "update", "timer"])
            elif kind == "save":  # pruning happens once KEEP older checkpoints are there
                plan["point"] = rng.choice([p for p in SAVE_POINTS if p != "pruning" or k > KEEP * EVERY])
            elif rng.random() < 0.3:
                plan["cut"] = 1.0  # the whole row but its line end
            out.append(plan)
        kinds = [p["kind"] for p in out]
        if all(kinds.count(kind) >= 4 for kind in ("step", "save", "metrics")):
            break
    first = next(p for p in out if p["kind"] == "metrics")
    first["cut"] = 1.0  # at least once: a row that parses, but lacks its line end
    return out + [{"kind": "end", "point": p, "cut": rng.random()} for p in END_POINTS]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact_checkpoints(run: Path) -> list[int]:
    """Steps of the checkpoint folders (``checkpoints/step-NNNNNNN``) whose manifest is whole and whose every file
    has the size and SHA-256 it lists: written here without the project's checkpoint code."""
    found = []
    for folder in (run / "checkpoints").glob("step-*"):
        try:
            files = json.loads((folder / "manifest.json").read_text())["files"]
        except (OSError, ValueError, KeyError):
            continue
        if all(
            (folder / name).is_file()
            and (folder / name).stat().st_size == entry["bytes"]
            and sha256(folder / name) == entry["sha256"]
            for name, entry in files.items()
        ):
            found.append(int(folder.name[5:]))
    return sorted(found)


def weights_digest(folder: Path) -> str:
    """SHA-256 over the tensors (names, dtypes, shapes, bytes) of a saved transformer's safetensors files."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
                h.update(t.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rows(run: Path) -> list[dict]:
    """metrics.jsonl read strictly: every line whole (ended by its line end) and a JSON object."""
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n"), f"metrics.jsonl ends in a half row: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def temporaries(run: Path) -> list[str]:
    """Hidden files and folders the run's atomic writers leave while they write (``.name.PID.tmp``,
    ``.step-NNNNNNN.tmp``...), anywhere in the run folder."""
    return sorted(str(p.relative_to(run)) for p in run.rglob(".*") if p.name != ".lock")


def test_the_next_run_removes_what_killed_writers_left_and_nothing_else(tmp_path):
    from training import checkpoint as ckpt

    run = tmp_path / "run"
    ckpt.record_run_files(run, "config.yaml", "metrics.jsonl", "checkpoints/step-0000003", "final/transformer")
    left = [".metrics.jsonl.1234.tmp/metrics.jsonl", ".run_files.json.77.tmp/run_files.json", ".config.yaml.9.old"]
    left += ["checkpoints/.step-0000006.tmp/rank0.pt", "checkpoints/.step-0000003.del/training_state.pt"]
    left += ["checkpoints/.step-0000003.old/manifest.json", "final/.transformer.41.tmp/config.json"]
    mine = [".notes.txt.12.tmp", "checkpoints/.hidden", "data/.config.yaml.5.tmp", "checkpoints/.step-3.tmp", ".lock"]
    mine += ["final/.lora.8.tmp/x"]  # a LoRA run lists final/lora: this run did not
    for name in [*left, *mine]:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    removed = ckpt.sweep_temporaries(run)
    assert removed == sorted(
        [".metrics.jsonl.1234.tmp", ".run_files.json.77.tmp", ".config.yaml.9.old", "checkpoints/.step-0000006.tmp"]
        + ["checkpoints/.step-0000003.del", "checkpoints/.step-0000003.old", "final/.transformer.41.tmp"]
    )
    assert sorted(temporaries(run)) == sorted(
        {".notes.txt.12.tmp", "checkpoints/.hidden", "data/.config.yaml.5.tmp", "checkpoints/.step-3.tmp"}
        | {"final/.lora.8.tmp"}
    )
    assert (run / ".lock").is_file() and (run / ckpt.RUN_MANIFEST).is_file()


@pytest.mark.slow  # twenty-two runs of the tiny recipe
def test_a_run_killed_anywhere_twenty_times_ends_as_an_uninterrupted_one(tmp_path):
    seed = int(os.environ.get("MHLA_TEST_SEED", random.SystemRandom().randrange(2**31)))
    rng = random.Random(seed)
    todo = plans(rng)
    replay = f"MHLA_TEST_SEED={seed}"
    print(replay)
    overrides = ["log.tensorboard=false", f"train.steps={STEPS}", f"checkpoint.every={EVERY}"]
    overrides += [f"checkpoint.keep={KEEP}", "log.param_digest=true", "resume=latest"]
    server = Server()
    try:
        straight = tmp_path / "straight"
        argv = ["--config", TINY, f"run_dir={straight}", *overrides]
        rc = server.run(argv, tmp_path / "straight.log", tmp_path / "straight.journal", None)
        assert rc == 0, tail(tmp_path / "straight.log")

        run = tmp_path / "killed"
        argv = ["--config", TINY, f"run_dir={run}", *overrides]
        journal = tmp_path / "journal.jsonl"
        start, half_row = 0, False
        for n, plan in enumerate([*todo, None]):
            log = tmp_path / f"run{n:02d}.log"
            if plan is not None:
                plan["start"] = start
            rc = server.run(argv, log, journal, plan)
            what = f"{replay}; run {n} ({plan}); its log:\n{tail(log)}"
            # it resumed from the newest checkpoint whose every file matched its manifest, or started over
            said = re.findall(r"resumed from (\S+) at step (\d+)", log.read_text())
            if start:
                assert said == [(str(run / "checkpoints" / f"step-{start:07d}"), str(start))], what
            else:
                assert not said, what
            assert ("half-written row" in log.read_text()) == (half_row and start > 0), what
            if plan is None:
                assert rc == 0, what
                break
            # killed where it was planned, never stopped by an error (a half-written file read as whole)
            assert rc == -9, what
            event = [json.loads(x) for x in journal.read_text().splitlines()][-1]
            assert event["event"] == "killed" and event["kind"] == plan["kind"], what
            if plan["kind"] != "end":
                assert event["step"] == plan["step"], what
            saved = [json.loads(x)["step"] for x in journal.read_text().splitlines() if '"saved"' in x]
            found = intact_checkpoints(run)
            start = found[-1] if found else 0
            assert start >= max(saved, default=0), f"a completed checkpoint was lost; {what}"
            text = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").is_file() else ""
            half_row = bool(text) and not text.endswith("\n")
            assert half_row == (plan["kind"] == "metrics" or plan.get("point") == "end-row"), what

        # the same run as the uninterrupted one: weights bit for bit, every metrics row once, the same numbers
        assert weights_digest(run / "final" / "transformer") == weights_digest(straight / "final" / "transformer")
        assert (run / "param_digest" / "rank0.txt").read_text() == (straight / "param_digest" / "rank0.txt").read_text()
        got = [{k: v for k, v in r.items() if k not in TIMING} for r in rows(run)]
        want = [{k: v for k, v in r.items() if k not in TIMING} for r in rows(straight)]
        assert got == want, replay
        assert json.loads((run / "final" / "finished.json").read_text()) == {"step": STEPS, "model": "transformer"}
        assert intact_checkpoints(run) == [STEPS - EVERY, STEPS], replay
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
            f"step-{s:07d}" for s in (STEPS - EVERY, STEPS)
        ]
        assert temporaries(run) == [], replay  # what a killed writer left was removed by the next run
        kinds = [p["kind"] for p in todo]
        assert len(todo) == KILLS and min(kinds.count(k) for k in ("step", "save", "metrics")) >= 4
    finally:
        server.close()
