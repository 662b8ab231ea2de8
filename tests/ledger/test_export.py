"""``--export-blocklist``: what goes in (``--min-share``, the share floor), and a blocklist that is never
lost to a kill while it is rewritten (a real SIGTERM to the command, mid-write)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradloc_track.cli import main
from gradloc_track.data import load_blocklist
from gradloc_track.ledger.aggregate import by_sample, collect
from gradloc_track.ledger.export import SHARE_FLOOR, blocklist_entries
from gradloc_track.ledger.sources import RunTable

from ..conftest import ROOT

COLS = ["step", "level", "token", "share", "sample", "position", "end", "sample_id", "dataset_index"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def run_with(root: Path, rows: list[list]) -> Path:
    d = root / "run"
    (d / "spikes" / "tokens").mkdir(parents=True)
    (d / "spikes" / "tokens" / "step_000100.json").write_text(json.dumps({"columns": COLS, "data": rows}))
    return d


def test_noise_rows_are_not_exported_and_negative_shares_never_shown(tmp_path, capsys):
    # a packed row: the document at 95% and the noise beside it (measured: 2%, 2%, 0%, -0%)
    shares = {"d2": 0.95, "pad": 0.02, "i": 0.02, "d": 0.0, "neg": -0.0007}
    rows = [[100, "document", k, v, 0, 10 * i, 10 * i + 10, f"{i:016x}", i] for i, (k, v) in enumerate(shares.items())]
    run = run_with(tmp_path, rows)
    block = tmp_path / "b.json"
    assert main(["culprits", str(run), "-o", str(tmp_path / "l"), "--export-blocklist", str(block)]) == 0
    out = capsys.readouterr().out
    assert [e["text"] for e in load_blocklist(block).read_entries()] == ["d2"]
    assert "1 sample(s); 4 under --min-blamed 1 or --min-share 0.05 left out" in out
    doc = json.loads((tmp_path / "l" / "culprits.json").read_text())
    assert min(s["max_share"] for s in doc["samples"]) == 0.0 and "-0%" not in out and "-" not in \
        "".join(f"{s['max_share']}" for s in doc["samples"])
    assert main(["culprits", str(run), "-o", str(tmp_path / "l"), "--export-blocklist", str(block),
                 "--min-share", "0"]) == 0
    assert len(load_blocklist(block)) == 5  # the floor is an option
    with pytest.raises(SystemExit):
        main(["culprits", str(run), "--min-share", "1.5"])
    assert "is not a share" in capsys.readouterr().err


def test_the_default_floor_is_the_documented_one():
    assert SHARE_FLOOR == 0.05 and "0.05" in (ROOT / "docs" / "ledger.md").read_text()
    samples = [{"sample_id": "0" * 16, "blamed": 3, "runs": [], "steps": [], "max_share": 0.049, "text": ""},
               {"sample_id": "1" * 16, "blamed": 1, "runs": [], "steps": [], "max_share": 0.05, "text": ""}]
    assert [e["sample_id"] for e in blocklist_entries(samples)] == ["1" * 16]


def test_a_sample_blamed_at_many_indices_is_exported_with_every_one(tmp_path, capsys):
    """The ledger shows at most 5 distinct indices of a sample ("100 | ... | 104 (+2)"); the blocklist took that
    display text back apart, so 105 and 106 were not blocked and "104 (+2)" matched no record (held-out tester,
    stop 63). The index now comes from the ledger's rows."""
    runs = tmp_path / "runs"
    for i in range(7):  # another seed, shuffle or epoch each: the same text at another dataset index
        d = runs / f"seed{i}" / "spikes" / "tokens"
        d.mkdir(parents=True)
        (d / "step_000010.json").write_text(json.dumps({"columns": COLS, "data": [
            [10, "sample", "junk", 0.9, 0, 0, 4, "a" * 16, 100 + i]]}))
    block = tmp_path / "b.json"
    assert main(["culprits", str(runs), "-o", str(tmp_path / "l"), "--export-blocklist", str(block)]) == 0
    (entry,) = load_blocklist(block).read_entries()
    assert entry["index"] == list(range(100, 107))
    assert sorted(load_blocklist(block).indices) == list(range(100, 107))
    shown = json.loads((tmp_path / "l" / "culprits.json").read_text())["samples"][0]["dataset_index"]
    assert shown == "100 | 101 | 102 | 103 | 104 (+2)"  # the page's cell stays short


def test_an_index_cell_that_lists_several_is_read_flat_and_a_float_index_is_said(tmp_path, capsys):
    """Review, stop 63: a sample whose index cell was a list in one row and a number in another was exported as
    the nested [[1, 2], 3], which the blocklist refused with a traceback; a float index raised it too."""
    def run(name: str, index) -> None:
        d = tmp_path / "runs" / name / "spikes" / "tokens"
        d.mkdir(parents=True)
        (d / "step_000010.json").write_text(json.dumps({"columns": COLS, "data": [
            [10, "sample", "junk", 0.9, 0, 0, 4, "a" * 16, index]]}))

    run("a", [1, 2])
    run("b", 3)
    block = tmp_path / "b.json"
    assert main(["culprits", str(tmp_path / "runs"), "-o", str(tmp_path / "l"), "--export-blocklist", str(block)]) == 0
    (entry,) = load_blocklist(block).read_entries()
    assert entry["index"] == [1, 2, 3]
    run("c", 4.5)
    capsys.readouterr()
    assert main(["culprits", str(tmp_path / "runs"), "-o", str(tmp_path / "l2"), "--export-blocklist",
                 str(tmp_path / "b2.json")]) == 2
    err = capsys.readouterr().err
    assert "--export-blocklist" in err and "not written" in err and "4.5" in err and "Traceback" not in err


def _temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def test_sigterm_while_the_blocklist_is_rewritten_leaves_a_whole_blocklist(tmp_path):
    n = 3000  # distinct samples: a blocklist of ~0.5 MB, written in pieces
    run = run_with(tmp_path, [[100, "sample", f"document {i}", 0.5, i, 0, 9, f"{i:016x}", i] for i in range(n)])
    folder = tmp_path / "blocklists"
    block = folder / "b.json"
    cmd = [sys.executable, "-m", "gradloc_track.cli", "culprits", str(run), "-o", str(tmp_path / "l"),
           "--export-blocklist", str(block)]
    subprocess.run(cmd, env=ENV, check=True, capture_output=True, timeout=120)  # the existing blocklist
    assert len(load_blocklist(block)) == n
    interrupted = 0
    for attempt in range(6):
        before, was = block.read_bytes(), _stat(block)
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        # the rewrite has begun: a temp file beside it, or the file itself touched (an in-place rewrite)
        while not _temp_files(folder) and _stat(block) == was and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)  # mid-write (a busy box may be late)
        _, err = proc.communicate(timeout=60)
        assert b"Traceback" not in err, err[-2000:]
        # the old file or the whole new one, never an empty or a cut one, and no temp file left
        assert block.read_bytes() == before or len(load_blocklist(block)) == n
        assert len(load_blocklist(block)) == n and not _temp_files(folder), f"attempt {attempt}"
        interrupted += proc.returncode == 128 + signal.SIGTERM  # SystemExit(143) from our handler
        if interrupted == 3:
            break
    assert interrupted >= 2, f"the rewrite was interrupted only {interrupted} time(s) in {attempt + 1}"


def test_a_sample_that_made_a_step_nan_is_exported_without_a_share():
    """A non-finite step's row has no share (``spikes/tokens``' ``nonfinite`` column): the blocklist
    takes its sample anyway; a finite row under the share floor stays out."""
    cols = COLS + ["nonfinite"]
    rows = [[7, "token", "x", None, 3, 5, 6, "a" * 16, 11, True],
            [9, "sample", "y", 0.01, 0, 0, 8, "b" * 16, 12, False]]
    run = RunTable(run_id="r1", name="run", table={"columns": cols, "data": rows})
    samples = by_sample(collect([run]))
    assert {(s["sample_id"], s.get("nonfinite")) for s in samples} == {("a" * 16, True), ("b" * 16, None)}
    entries = blocklist_entries(samples)
    assert [(e["sample_id"], e["index"], e["nonfinite"]) for e in entries] == [("a" * 16, 11, True)]


def test_the_console_says_a_nan_steps_culprit_has_no_share_not_zero(tmp_path, capsys):
    d = tmp_path / "run"
    (d / "spikes" / "tokens").mkdir(parents=True)
    (d / "spikes" / "tokens" / "step_000007.json").write_text(json.dumps(
        {"columns": COLS + ["nonfinite"], "data": [[7, "sample", "x", None, 3, 0, 6, "a" * 16, 11, True]]}))
    assert main(["culprits", str(d), "-o", str(tmp_path / "l")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "a" * 16 in x)
    assert "a non-finite step (no share)" in line and "max share 0%" not in line
