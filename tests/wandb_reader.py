"""Read an offline W&B run's ``.wandb`` file back (LevelDB log framing + wandb's protobuf records).

wandb 0.30 ships no reader for its own transaction log, so the tests carry this small one.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7  # crc32 (4) + length (2) + type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    pos = 7  # the file starts with a 7-byte W&B header: b":W&B" + version
    buf = b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos: pos + HEADER])
        chunk = data[pos + HEADER: pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind in (FULL, FIRST):
            buf = chunk
        else:
            buf += chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def history(run_dir: str | Path) -> list[dict]:
    """Every ``run.log`` row of an offline run, as dicts of decoded values."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item})
    return rows


def summary(run_dir: str | Path) -> dict:
    """The run summary as last written (``run.summary[...] = ...`` updates)."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    out: dict = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "summary":
            for it in rec.summary.update:
                out[it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
    return out
