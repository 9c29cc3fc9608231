"""Checksums of a latent cache (``python -m training.precompute``): a damaged entry or index is refused by name,
never trained on as garbage.

A cache written by this code carries a checksum per entry and one over its index:

- each ``sample_XXXXXXX.safetensors`` (and ``empty_text.safetensors``) has in its own header (``__metadata__``)
  ``sha256``: :func:`entry_digest` of its tensors (names, dtypes, shapes, bytes) and its caption, so an entry
  vouches for itself (a re-run of precompute checks the files an interrupted run left, before any index exists);
- ``index.json`` (the manifest) lists each entry's ``bytes`` and ``sha256`` (and ``empty_text``'s), and carries
  ``index_sha256``: the SHA-256 of the rest of the index (:func:`index_digest`; a changed caption or checksum in
  it is found).

When what is checked (a full hash reads the whole cache; a training run may open a cache of many gigabytes):

- at open (:func:`read_index`, every training run, before the model loads): the index against its checksum, and
  every entry there with the size the index lists (a truncated or missing entry is found here, by ``stat``);
- at load (:func:`load_entry`, each time training reads an entry): the entry's tensors against the index's
  ``sha256``; it is read whole anyway, and checking it costs about 2.5 ms per MB on a busy 2-core CPU (a 12 MB
  entry of an 81-frame 480p clip: 30 ms, against seconds for a training step on it);
- in full: ``python -m training.precompute --out DIR --verify`` (:func:`verify_cache`: every entry, nothing
  written), and a re-run of precompute, which checks every entry already there against its own header and writes
  a damaged one again (:func:`intact_metadata`).

A damaged file is a :class:`CacheDamaged` (exit 2) naming it, with the command that writes it again. A cache
written before checksums (its index has no ``index_sha256``) still loads, with a note: its entries are checked
only to parse; a re-run of precompute over it adds the checksums to its index (of the entries as they are).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from common.errors import BadInputError

INDEX = "index.json"
EMPTY_TEXT = "empty_text.safetensors"
DIGEST_KEY = "sha256"  # in an entry's header metadata and in its index item
INDEX_DIGEST_KEY = "index_sha256"
_noted: set[str] = set()  # caches without checksums said once per process


class CacheDamaged(BadInputError):
    """A cache file that is not what its checksum says (exit 2). Raised in a DataLoader worker, torch re-raises it in
    the main process with the worker's traceback as the message; only the original message is kept."""

    def __init__(self, message: str):
        marker = f"{type(self).__name__}: "
        if message.startswith("Caught ") and marker in message:  # torch's ExceptionWrapper.reraise
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


def entry_digest(tensors: dict[str, torch.Tensor], caption: str = "") -> str:
    """SHA-256 of a cache entry: its caption, then each tensor (by name) as name, dtype, shape and raw bytes."""
    h = hashlib.sha256()
    h.update(caption.encode("utf-8") + b"\0")
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # the buffer itself, not a copy
    return h.hexdigest()


def sealed_metadata(tensors: dict[str, torch.Tensor], metadata: dict[str, Any] | None) -> dict[str, Any]:
    """An entry's header metadata with its :func:`entry_digest` (of ``metadata["caption"]``, "" when none)."""
    metadata = dict(metadata or {})
    metadata[DIGEST_KEY] = entry_digest(tensors, metadata.get("caption", ""))
    return metadata


def index_digest(index: dict[str, Any]) -> str:
    """SHA-256 of an index without its own checksum, as canonical JSON (sorted keys, no spaces)."""
    rest = {k: v for k, v in index.items() if k != INDEX_DIGEST_KEY}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _rewrite_hint(root: Path) -> str:
    return (
        f"run `python -m training.precompute` with the cache's config and --out {str(root)!r} again: it checks every "
        "entry and writes the damaged ones again"
    )


class _Damaged(Exception):
    """Why a cache file is damaged (naming it), before the advice is added."""


def _header(data: bytes, path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file's bytes (tensor entries and ``__metadata__``)."""
    if len(data) < 8:
        raise _Damaged(f"cache entry {str(path)!r} has {len(data)} bytes (truncated)")
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8")) if 8 + size <= len(data) else None
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise _Damaged(f"cache entry {str(path)!r} has no readable safetensors header (truncated or damaged)")
    return header


def _tensors(data: bytes, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as e:  # noqa: BLE001 - SafetensorError and friends: a damaged file, named
        first = " ".join(str(e).split())[:160] or type(e).__name__
        raise _Damaged(f"cache entry {str(path)!r} is not a readable safetensors file ({first})") from None


def _checked(root: Path, item: dict[str, Any]) -> dict[str, torch.Tensor]:
    path = root / item["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _Damaged(f"cache entry {str(path)!r} is missing") from None
    if "bytes" in item and len(data) != item["bytes"]:
        raise _Damaged(
            f"cache entry {str(path)!r} has {len(data)} bytes, the index says {item['bytes']} (truncated or changed)"
        )
    _header(data, path)
    tensors = _tensors(data, path)
    if DIGEST_KEY in item and entry_digest(tensors, item.get("caption", "")) != item[DIGEST_KEY]:
        raise _Damaged(
            f"cache entry {str(path)!r} does not match its SHA-256 in {str(root / INDEX)!r} (corrupted or changed)"
        )
    return tensors


def read_index(root: str | Path, check_sizes: bool = True) -> dict[str, Any]:
    """A cache's ``index.json``, checked against its own checksum, and (``check_sizes``) every entry there with the
    size it lists (the open-time check: ``stat`` only). An index without checksums (a cache written before them)
    is returned as it is, with a note on stderr. FileNotFoundError when ``root`` holds no index; CacheDamaged
    naming the file otherwise."""
    root = Path(root)
    path = root / INDEX
    if not path.is_file():
        raise FileNotFoundError(f"{str(root)!r} is not a precomputed cache (no {INDEX}); run training/precompute.py")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CacheDamaged(
            f"cache index {str(path)!r} is not readable JSON ({e}): truncated or damaged; {_rewrite_hint(root)}"
        ) from None
    items = index.get("items") if isinstance(index, dict) else None
    if not isinstance(items, list) or not all(isinstance(x, dict) and isinstance(x.get("file"), str) for x in items):
        raise CacheDamaged(
            f"cache index {str(path)!r} does not list entries (items with a file); {_rewrite_hint(root)}"
        )
    for item in items:
        name = item["file"]
        if not name or Path(name).name != name:  # a file of the cache, never a path out of it
            raise CacheDamaged(f"cache index {str(path)!r} names {name!r}; expected a file name in {str(root)!r}")
    if INDEX_DIGEST_KEY not in index:
        if str(root) not in _noted and int(os.environ.get("RANK", "0")) == 0:
            _noted.add(str(root))
            print(
                f"note: cache {str(root)!r} was written without checksums (before they existed): its entries are "
                "checked only to parse; a re-run of training.precompute into it adds them",
                file=sys.stderr,
            )
        return index
    if index[INDEX_DIGEST_KEY] != index_digest(index):
        raise CacheDamaged(
            f"cache index {str(path)!r} does not match its own checksum ({INDEX_DIGEST_KEY}): changed or damaged; "
            f"{_rewrite_hint(root)}"
        )
    bad = []
    for item in [*items, empty_text_item(index)] if check_sizes else []:
        if "bytes" not in item:
            continue
        file = root / item["file"]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            bad.append(f"cache entry {str(file)!r} is missing")
            continue
        if size != item["bytes"]:
            bad.append(
                f"cache entry {str(file)!r} has {size} bytes, the index says {item['bytes']} (truncated or changed)"
            )
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CacheDamaged(
            f"cache {str(root)!r}: {len(bad)} damaged entr{'y' if len(bad) == 1 else 'ies'}: {'; '.join(bad[:3])}"
            f"{more}; {_rewrite_hint(root)}"
        )
    return index


def load_entry(root: str | Path, item: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of the cache entry ``item`` (an index item: ``file``, ``caption``, and in a cache with checksums
    ``bytes``, ``sha256``), read whole and checked against its checksum; CacheDamaged naming the file when it is
    missing, cut short, unreadable or not what its checksum says."""
    root = Path(root)
    try:
        return _checked(root, item)
    except _Damaged as e:
        raise CacheDamaged(f"{e}; {_rewrite_hint(root)}") from None


def latents_shape(path: str | Path) -> tuple[int, ...]:
    """The shape of a cache entry's ``latents`` from its header (the file is not read further); CacheDamaged
    naming the file when the header is unreadable or lists no latents."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            start = f.read(8)
            head = start + f.read(struct.unpack("<Q", start)[0]) if len(start) == 8 else start
        shape = _header(head, path).get("latents", {}).get("shape")
        if not isinstance(shape, list):
            raise _Damaged(f"cache entry {str(path)!r} holds no latents")
    except FileNotFoundError:
        raise CacheDamaged(f"cache entry {str(path)!r} is missing; {_rewrite_hint(path.parent)}") from None
    except _Damaged as e:
        raise CacheDamaged(f"{e}; {_rewrite_hint(path.parent)}") from None
    return tuple(int(x) for x in shape)


def empty_text_item(index: dict[str, Any]) -> dict[str, Any]:
    """The index item of ``empty_text.safetensors`` (only its name in a cache written before checksums)."""
    return index.get("empty_text") or {"file": EMPTY_TEXT}


def intact_metadata(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """For a re-run of precompute: ``(metadata, None)`` of an entry already in the cache whose tensors match the
    checksum in its own header (one written before checksums: one that parses, its digest added), or
    ``(None, why)`` when it is damaged (it is written again), ``(None, None)`` when there is none."""
    path = Path(path)
    if not path.is_file():
        return None, None
    try:
        data = path.read_bytes()
        metadata = _header(data, path).get("__metadata__") or {}
        tensors = _tensors(data, path)
    except _Damaged as e:
        return None, str(e)
    if not isinstance(metadata.get("caption"), str):
        return None, f"cache entry {str(path)!r} has no caption in its header"
    digest = entry_digest(tensors, metadata["caption"])
    if DIGEST_KEY in metadata and metadata[DIGEST_KEY] != digest:
        return None, f"cache entry {str(path)!r} does not match the SHA-256 in its header (corrupted or changed)"
    return {**metadata, DIGEST_KEY: digest}, None


def seal_index(root: str | Path, index: dict[str, Any]) -> dict[str, Any]:
    """``index`` (as precompute assembled it) with each entry's ``bytes`` and ``sha256`` (from its header, else
    computed from its tensors: an entry written before checksums), ``empty_text``'s, and its own checksum."""
    root = Path(root)

    def sealed(item: dict[str, Any]) -> dict[str, Any]:
        path = root / item["file"]
        try:
            with path.open("rb") as f:  # the header only: the entry was checked when it was written or found
                start = f.read(8)
                head = start + f.read(struct.unpack("<Q", start)[0]) if len(start) == 8 else start
            digest = (_header(head, path).get("__metadata__") or {}).get(DIGEST_KEY)
            if digest is None:  # written before checksums (it parsed when the re-run found it)
                digest = entry_digest(_tensors(path.read_bytes(), path), item.get("caption", ""))
        except _Damaged as e:  # changed since, moments ago
            raise CacheDamaged(f"{e}; {_rewrite_hint(root)}") from None
        return {**item, "bytes": path.stat().st_size, DIGEST_KEY: digest}

    out = {**index, "items": [sealed(item) for item in index["items"]], "empty_text": sealed({"file": EMPTY_TEXT})}
    out[INDEX_DIGEST_KEY] = index_digest(out)
    return out


def verify_cache(root: str | Path) -> tuple[int, list[str], bool]:
    """Every entry of the cache in ``root`` and ``empty_text`` read and checked: ``(entries, why each damaged file
    is, whether the cache has checksums)``; an unreadable index raises CacheDamaged."""
    root = Path(root)
    index = read_index(root, check_sizes=False)  # each entry's size is checked, and named, below
    damaged = []
    for item in [*index["items"], empty_text_item(index)]:
        try:
            _checked(root, item)
        except _Damaged as e:
            damaged.append(str(e))
    return len(index["items"]), damaged, INDEX_DIGEST_KEY in index
