"""The records of a W&B run file (``run-<id>.wandb``, what an offline run writes), read back in tests.

The file is a 7-byte header (``:W&B``, a 2-byte magic, a version byte) and then the LevelDB log
format: 32 KiB blocks of chunks, each chunk a 7-byte header (CRC32, little-endian uint16 length,
type: 1 full, 2 first, 3 middle, 4 last) and its payload; a block's tail too short for a header
is zero padding. A whole record is one ``wandb_internal_pb2.Record`` protobuf message. The
checksums are not verified: a test reads what the run it just made wrote.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    records, parts, pos = [], [], 7
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the block's zero padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:  # zeros to the end of the block
            pos += left
            continue
        payload = data[pos + CHUNK_HEADER: pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        parts = [payload] if kind in (FULL, FIRST) else [*parts, payload]
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
    return records


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def history(records) -> list[dict]:
    """Every logged row (``run.log``), in order: its keys with ``_step``."""
    return [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]


def run_record(records):
    """The run's own record (id, project, display name, config)."""
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def config(records) -> dict:
    """The run's config, as its keys' values (``run.config``)."""
    out = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        out.update({k: v for k, v in _items(updates).items() if k != "_wandb"})
    return out


def exit_code(records) -> int | None:
    return next((r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"), None)
