"""Read an offline W&B run's ``.wandb`` file back (LevelDB log framing + wandb's protobuf records).

wandb 0.30 ships no reader for its own transaction log, so the tests carry this small one.
"""
from __future__ import annotations

import json
import struct
import time
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
        if pos + HEADER + length > len(data):
            return  # the tail of a record still being written
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
            try:
                rec.ParseFromString(buf)
            except Exception:  # a record still being written
                return
            yield rec
            buf = b""


def complete_records(run_dir: str | Path, timeout_s: float = 120.0) -> list:
    """The run's records once its log is closed (ends with the ``exit`` record).

    ``run.finish()`` only *informs* wandb-core that the run is done; the service writes and
    closes the transaction log afterwards, so on a slow machine the file can still be a
    buffered prefix when ``finish()`` returns.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        paths = list(Path(run_dir).glob("run-*.wandb"))
        recs = list(records(paths[0])) if len(paths) == 1 else []
        if recs and recs[-1].WhichOneof("record_type") == "exit":
            return recs
        if time.monotonic() > deadline:
            kinds = [r.WhichOneof("record_type") for r in recs]
            raise AssertionError(f"{run_dir}: the .wandb log never closed within {timeout_s:.0f} s "
                                 f"(files {paths}, last records {kinds[-5:]})")
        time.sleep(0.2)


def history(run_dir: str | Path) -> list[dict]:
    """Every ``run.log`` row of an offline run, as dicts of decoded values."""
    rows = []
    for rec in complete_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item})
    return rows


def summary(run_dir: str | Path) -> dict:
    """The run summary as last written (``run.summary[...] = ...`` updates)."""
    out: dict = {}
    for rec in complete_records(run_dir):
        if rec.WhichOneof("record_type") == "summary":
            for it in rec.summary.update:
                out[it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
    return out
