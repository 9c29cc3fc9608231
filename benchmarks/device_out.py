"""What a device call brings back, kept inside its limits whatever happens.

The device tool returns at most 8 files from ``$OUT`` (16 MiB each, 64 MiB together, no more than 2 folders
down, each file and folder named in letters, digits, '.', '_' and '-'); anything past that is left out, and
which file goes is not ours to choose. ``benchmarks/run_gpu.sh`` therefore writes its log straight into
``$OUT`` and has every stage write into a staging folder; after each stage and once more on exit (a bash
``trap ... EXIT``, also on a failure, a timeout or a signal) it calls ``publish``, which keeps ``$OUT`` at
8 files or fewer at every moment:

- the log is always one of them (and trimmed below 16 MiB: ``trim_log``);
- when all the results fit beside it, they are copied in as they are;
- else the largest ones that fit (weights, videos: what would crowd an archive) are copied in as they are, and
  everything else goes into one ``.tar.gz`` beside them (the tables among them are in the log too), so nothing
  is dropped; a file that neither fits $OUT nor the archive's 16 MiB is the only thing left behind, and the log
  says which.

Standard library only, run as ``python3 -I benchmarks/device_out.py ...`` (no PYTHONPATH, no torch):

    python3 -I benchmarks/device_out.py publish --results DIR --out OUT --log log.txt \\
        --archive results_h200.tar.gz --state STATE.json [--list]
    python3 -I benchmarks/device_out.py trim-log LOG --from BYTES [--keep BYTES]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20 - 64 * 2**10  # 16 MiB each, a little kept back
MAX_TOTAL_BYTES = 64 * 2**20 - 256 * 2**10  # 64 MiB together
MAX_FOLDERS = 2  # $OUT/a/b/file comes back, $OUT/a/b/c/file does not
LOG_MAX_BYTES = 12 * 2**20  # the log's own ceiling: room for the archive and the tables beside it
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
KINDS = ((".md", ".txt"), (".json", ".csv", ".log"))  # listed in this order: tables, data, the rest


def returnable(rel: str) -> bool:
    """Whether the device brings back a file at ``$OUT/rel`` (its name and depth; not its size)."""
    parts = rel.split("/")
    if len(parts) > MAX_FOLDERS + 1:
        return False
    return all(NAME.match(p) and p not in (".", "..") for p in parts)


def kind(rel: str) -> int:
    for i, suffixes in enumerate(KINDS):
        if rel.lower().endswith(suffixes):
            return i
    return len(KINDS)


def files_under(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` (links to files followed, links to folders not)."""
    found = {}
    if not root.is_dir():
        return found
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = Path(folder, name)
            if path.is_file():
                found[path.relative_to(root).as_posix()] = path.stat().st_size
    return found


@dataclass
class Plan:
    direct: list[str] = field(default_factory=list)  # copied into $OUT as they are
    packed: list[str] = field(default_factory=list)  # in the archive
    left: dict[str, str] = field(default_factory=dict)  # not brought back: path -> why


def plan(order: Sequence[str], sizes: dict[str, int], slots: int, room: int, reserved: Sequence[str] = ()) -> Plan:
    """Which results go into ``$OUT`` directly and which into the archive, for ``slots`` files and ``room``
    bytes beside the log (the archive's 16 MiB is kept back from ``room`` once it is needed)."""
    result = Plan()
    ranked = sorted(order, key=lambda rel: (kind(rel), order.index(rel)))
    fits = [r for r in ranked if returnable(r) and r not in reserved and sizes[r] <= MAX_FILE_BYTES]
    if len(order) <= slots and len(fits) == len(order) and sum(sizes.values()) <= room:
        result.direct = list(ranked)
        return result
    if slots < 1:
        result.left = {r: "no file left in $OUT's 8 for an archive" for r in ranked}
        return result
    room -= min(room, MAX_FILE_BYTES)  # the archive's share
    used = 0
    for rel in sorted(fits, key=lambda r: -sizes[r]):  # the largest directly: the archive holds 16 MiB
        if len(result.direct) < slots - 1 and used + sizes[rel] <= room:
            result.direct.append(rel)
            used += sizes[rel]
    result.direct.sort(key=ranked.index)
    result.packed = [r for r in ranked if r not in result.direct]
    return result


def build_archive(results: Path, members: list[str], sizes: dict[str, int], dest: Path, limit: int) -> dict[str, str]:
    """Writes ``dest`` (.tar.gz) with ``members``, dropping the largest ones until it is at most ``limit``
    bytes; returns the dropped ones with why."""
    dropped = {}
    members = list(members)
    # a first cut without compressing: more than 8x the limit never fits (results compress 2-5x at best)
    while members and sum(sizes[m] for m in members) > 8 * limit:
        big = max(members, key=lambda m: sizes[m])
        members.remove(big)
        dropped[big] = f"{sizes[big] / 2**20:.1f} MiB: too big for the {limit / 2**20:.1f} MiB archive"
    for _ in range(12):
        with tarfile.open(dest, "w:gz", compresslevel=6, dereference=True) as tar:
            for m in members:
                tar.add(results / m, arcname=m, recursive=False)
        if dest.stat().st_size <= limit or not members:
            break
        big = max(members, key=lambda m: sizes[m])
        members.remove(big)
        dropped[big] = f"{sizes[big] / 2**20:.1f} MiB: too big for the {limit / 2**20:.1f} MiB archive"
    return dropped


def _remove(out: Path, rel: str) -> None:
    path = out / rel
    if path.is_file() or path.is_symlink():
        path.unlink()
    parent = path.parent
    while parent != out and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def _same(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.stat(), b.stat()
    except OSError:
        return False
    return sa.st_size == sb.st_size and int(sa.st_mtime) == int(sb.st_mtime)


def publish(results: Path, out: Path, log: str, archive: str, state_path: Path) -> Plan:
    """Brings ``$OUT`` up to date with ``results`` (see the module's docstring); never more than
    ``MAX_FILES`` files in ``out`` at any moment, the log among them."""
    results, out, state_path = Path(results), Path(out), Path(state_path)
    out.mkdir(parents=True, exist_ok=True)
    state = {"order": [], "direct": [], "archive": None}
    if state_path.is_file():
        state.update(json.loads(state_path.read_text()))
    sizes = files_under(results)
    order = [r for r in state["order"] if r in sizes]
    order += sorted((r for r in sizes if r not in order), key=lambda r: (kind(r), r))
    ours = set(state["direct"]) | ({state["archive"]} if state["archive"] else set())
    present = files_under(out)
    foreign = {r: s for r, s in present.items() if r != log and r not in ours}
    log_bytes = present.get(log, 0)
    slots = MAX_FILES - 1 - len(foreign)
    room = MAX_TOTAL_BYTES - log_bytes - sum(foreign.values())
    chosen = plan(order, sizes, slots, room, reserved=(log, archive))

    packed_path = state_path.with_name(archive)
    if chosen.packed:
        limit = min(MAX_FILE_BYTES, room - sum(sizes[r] for r in chosen.direct))
        dropped = build_archive(results, chosen.packed, sizes, packed_path, max(limit, 0))
        chosen.left.update(dropped)
        chosen.packed = [r for r in chosen.packed if r not in dropped]
    wanted = set(chosen.direct) | ({archive} if chosen.packed else set())
    stale = [r for r in sorted(ours) if r not in wanted]
    # the order keeps the count at or under MAX_FILES throughout: an archive that takes a new slot goes in
    # only once the files it now holds have left $OUT (they are in it already, so a kill loses nothing)
    if chosen.packed and (archive in present or len(present) + 1 <= MAX_FILES):
        shutil.move(packed_path, out / archive)
        for r in stale:
            _remove(out, r)
    else:
        for r in stale:
            _remove(out, r)
        if chosen.packed:
            shutil.move(packed_path, out / archive)
    for r in chosen.direct:
        src, dst = results / r, out / r
        if not _same(src, dst):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    state = {"order": order, "direct": chosen.direct, "archive": archive if chosen.packed else None}
    state_path.write_text(json.dumps(state, indent=1) + "\n")
    return chosen


def trim_log(log: Path, start: int = 0, keep: int = 2 * 2**20) -> int:
    """Cuts the log's part from byte ``start`` to its first and last ``keep`` bytes when it is longer than
    twice that (a stage that printed megabytes); returns the bytes cut."""
    log = Path(log)
    size = log.stat().st_size
    if size - start <= 2 * keep:
        return 0
    with log.open("r+b") as f:
        f.seek(start)
        head = f.read(keep)
        f.seek(size - keep)
        tail = f.read(keep)
        cut = size - start - 2 * keep
        f.seek(start)
        f.write(head + f"\n[... {cut:,} bytes of output cut here to keep the log under 16 MiB ...]\n".encode())
        f.write(tail)
        f.truncate()
    return cut


def describe(out: Path, chosen: Plan, log: str, archive: str) -> str:
    present = sorted(files_under(out), key=lambda rel: (rel != log, rel != archive, rel))  # the log first
    lines = [f"=== $OUT holds {len(present)} files (the device brings back {MAX_FILES} at most): {', '.join(present)}"]
    if chosen.packed:
        lines.append(f"    {archive} holds {len(chosen.packed)}: {', '.join(chosen.packed)}")
    for rel, why in chosen.left.items():
        lines.append(f"!!! not brought back: {rel} ({why})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pub = sub.add_parser("publish", help="bring $OUT up to date with the staged results")
    pub.add_argument("--results", type=Path, required=True, help="the stages' staging folder")
    pub.add_argument("--out", type=Path, required=True, help="$OUT")
    pub.add_argument("--log", default="log.txt", help="the log's name in $OUT")
    pub.add_argument("--archive", default="results.tar.gz", help="the archive's name in $OUT")
    pub.add_argument("--state", type=Path, required=True, help="a file outside $OUT that remembers what is in it")
    pub.add_argument("--list", action="store_true", help="print what $OUT holds (else only what is left out)")
    trim = sub.add_parser("trim-log", help="cut a stage's output in the log to its head and tail")
    trim.add_argument("log", type=Path)
    trim.add_argument("--from", dest="start", type=int, default=0, help="where the stage's output starts (bytes)")
    trim.add_argument("--keep", type=int, default=2 * 2**20, help="bytes kept at each end (default 2 MiB)")
    args = p.parse_args(argv)
    if args.cmd == "trim-log":
        if args.log.is_file():
            trim_log(args.log, args.start, args.keep)
            if args.log.stat().st_size > LOG_MAX_BYTES:
                trim_log(args.log, 0, LOG_MAX_BYTES // 2 - 2**16)
        return 0
    log = args.out / args.log
    if log.is_file() and log.stat().st_size > LOG_MAX_BYTES:
        trim_log(log, 0, LOG_MAX_BYTES // 2 - 2**16)
    chosen = publish(args.results, args.out, args.log, args.archive, args.state)
    text = describe(args.out, chosen, args.log, args.archive)
    if args.list:
        print(text)
    else:
        for line in text.splitlines():
            if line.startswith("!!!"):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
