"""A checkpoint's files as they were saved: recorded by the save, checked before a load.

torch.distributed.checkpoint (DCP) reads whatever files its `.metadata` names and checks
nothing of their content: a truncated shard fails deep inside a read, and a shard of another
save under the same name loads silently wrong. DCP has no checksums, so graphpipe keeps its
own in the checkpoint's graphpipe.json:

    files    {".metadata": {"bytes": 812, "sha256": "9c0e..."}, "__0_0.distcp": {...}, ...}
    digest   the sha256 of the record's own JSON without "digest" (sorted keys)

A save hashes the files DCP wrote, each rank a share (file i on rank i % world); a load
checks the record's digest, that every file is there with its size and no other shard is,
and the hashes, each rank the same share again. Every problem names its file. `shallow`
checks leave the hashes out: what `graphpipe.latest` can afford for every candidate.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphpipe.errors import CheckpointError

__all__ = [
    "FORMAT",
    "META",
    "describe",
    "file_problems",
    "files_of",
    "hash_problems",
    "read_record",
    "seal",
    "share",
    "verify",
]

META = "graphpipe.json"
FORMAT = 2  # 2: with "files" and "digest"
CHUNK = 1 << 20  # bytes read at a time while hashing
SHARD_SUFFIX = ".distcp"  # DCP's data files


def files_of(path: Path) -> list[str]:
    """The names of the files DCP wrote into the directory `path`, sorted."""
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != META)


def share(names: Sequence[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` hashes: every world-th, from its rank on."""
    return list(names[rank::world])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def describe(path: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each file's size and sha256, by name."""
    return {n: {"bytes": (path / n).stat().st_size, "sha256": _sha256(path / n)} for n in names}


def _digest(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with its format and its digest (the last fields written)."""
    record = {**record, "format": FORMAT}
    return {**record, "digest": _digest(record)}


def read_record(path: Path) -> dict[str, Any]:
    """The checkpoint's graphpipe.json, checked against its own digest.

    Raises:
        CheckpointError: the file is missing, is not a JSON object, is of another format,
            or was changed after the save.
    """
    meta = path / META
    try:
        record = json.loads(meta.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{meta} is missing", path=str(path)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta} is unreadable: {exc}", path=str(path)) from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{meta} holds a {type(record).__name__}, not a record")
    if record.get("format") != FORMAT:
        raise CheckpointError(
            f"{meta} is checkpoint format {record.get('format')!r}; this graphpipe reads "
            f"format {FORMAT} (with the files' hashes)",
            path=str(path),
        )
    if record.get("digest") != _digest(record):
        raise CheckpointError(
            f"{meta} was changed after the save: its content does not match its digest",
            path=str(path),
        )
    return record


def file_problems(path: Path, record: dict[str, Any]) -> list[str]:
    """What is wrong with the files, by size and presence only: a recorded file missing or
    of another size, a shard the save did not write."""
    saved: dict[str, dict[str, Any]] = record["files"]
    problems = []
    for name, info in saved.items():
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{path / name} is missing (saved with {info['bytes']} bytes)")
            continue
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "not the file saved"
            problems.append(f"{path / name} is {size} bytes, {info['bytes']} when saved: {what}")
    for name in files_of(path):
        if name not in saved and name.endswith(SHARD_SUFFIX):
            problems.append(f"{path / name} is no file of this save (another save's or run's)")
    return problems


def hash_problems(path: Path, record: dict[str, Any], names: Sequence[str]) -> list[str]:
    """The files among `names` whose content is not the content saved (those missing or
    of another size are `file_problems`')."""
    saved: dict[str, dict[str, Any]] = record["files"]
    problems = []
    for name in names:
        if not (path / name).is_file() or (path / name).stat().st_size != saved[name]["bytes"]:
            continue  # file_problems names it
        found = _sha256(path / name)
        if found != saved[name]["sha256"]:
            problems.append(
                f"{path / name} is not the file saved (sha256 {found[:12]}..., saved "
                f"{saved[name]['sha256'][:12]}...): damaged, or another save's or run's"
            )
    return problems


def verify(path: Path, rank: int = 0, world: int = 1, deep: bool = True) -> list[str]:
    """Every problem this rank finds with the checkpoint at `path` (empty: none).

    Args:
        path: The checkpoint directory.
        rank: This rank; it hashes its share of the files.
        world: The ranks checking it together.
        deep: Hash the files (else sizes and presence only).
    """
    try:
        record = read_record(path)
    except CheckpointError as exc:
        return [str(exc)]
    problems = file_problems(path, record)
    if deep:
        problems += hash_problems(path, record, share(sorted(record["files"]), rank, world))
    return problems
