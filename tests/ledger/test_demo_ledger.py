"""Issue 19's done-when, with the real demo app and real MLflow reads: two runs with the same
injected document -> ``gradloc-track culprits`` lists it once, blamed in both, with fingerprint,
index and text; ``--by source`` groups it; ``--export-blocklist`` -> a third run with
``data.blocklist=FILE`` never sees it (the drop is logged) and does not spike at that step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradloc_track.artifacts import read_table
from gradloc_track.artifacts.identity import sample_fingerprint
from gradloc_track.cli import main

from .conftest import INJECT, demo_run, run_dir_of, summary_of


def junk_fingerprint(cache: Path) -> str:
    """The injected answer's sample_id, computed offline: its loss-bearing ids are the first
    ``span`` ids of the junk text (the prompt carries no loss), tokenized by the run's BPE."""
    from gradloc_track.demo.data import load_corpus
    from gradloc_track.demo.tokenizer import make_tokenizer

    tok = make_tokenizer("bpe", 1024, load_corpus(None), str(cache))
    junk = tok.encode("\u00e2\u20ac\u2122")
    return sample_fingerprint((junk * 2)[:2])


@pytest.fixture(scope="module", autouse=True)
def _in_the_runs_folder(two_runs):
    """MLflow roots a new experiment's artifacts at ./mlruns of the working directory when the process
    first opens the store: the module works in its runs' folder, not in the checkout."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(two_runs[0])
        yield


def ledger(root: Path, *args: str) -> dict:
    out = root / "ledger"
    assert main(["culprits", *args, "--tracking-uri", f"sqlite:///{root / 'mlflow.db'}", "-o", str(out)]) == 0
    return json.loads((out / "culprits.json").read_text(encoding="utf-8"))


def test_the_experiment_ledger_lists_the_injected_document_once_blamed_in_both_runs(two_runs, bpe_cache):
    root, dirs = two_runs
    doc = ledger(root, "gradloc-track", "--by", "source")
    assert doc["runs"] == ["seed0", "seed1"]
    bad = [s for s in doc["samples"] if s["source"] == "injected:garbled_span"]
    assert len(bad) == 1 and doc["samples"][0] is not None
    (s,) = bad
    assert s["sample_id"] == junk_fingerprint(bpe_cache)
    assert s["blamed"] == 2 and s["runs"] == ["seed0", "seed1"] and s["steps"] == [f"seed0@{INJECT}", f"seed1@{INJECT}"]
    assert s["dataset_index"] == INJECT * 4 + 1  # step 100, sample 1 of 4: its place in the data stream
    assert s["text"] == "\u00e2\u20ac" and 0.5 < s["max_share"] <= 1.0
    assert doc["samples"][0]["sample_id"] == s["sample_id"]  # the most blamed first
    # --by source: the injected source caused the spike of both runs
    group = {g["source"]: g for g in doc["groups"]}["injected:garbled_span"]
    assert (group["spikes"], group["of_spikes"], group["samples"]) == (2, doc["spike_events"], 1)
    assert group["summary"] == f"source injected:garbled_span caused 2 of {doc['spike_events']} spike(s)"
    csv_text = (root / "ledger" / "culprits_by_source.csv").read_text(encoding="utf-8")
    assert "injected:garbled_span" in csv_text
    page = (root / "ledger" / "culprits.html").read_text(encoding="utf-8")
    assert "Content-Security-Policy" in page and "<script" not in page.lower() and s["sample_id"] in page


def test_run_dirs_give_the_same_ledger_and_a_run_named_twice_counts_once(two_runs):
    root, dirs = two_runs
    by_dirs = ledger(root, *map(str, dirs))
    both = ledger(root, "gradloc-track", *map(str, dirs))  # the experiment and its runs' dirs
    assert both["runs"] == ["seed0", "seed1"] and both["spike_events"] == by_dirs["spike_events"]
    assert [(s["sample_id"], s["blamed"]) for s in both["samples"]] == \
        [(s["sample_id"], s["blamed"]) for s in by_dirs["samples"]]


def test_blocklist_then_a_third_run_never_sees_the_document(two_runs, bpe_cache):
    root, _ = two_runs
    block = root / "blocklist.json"
    ledger(root, "gradloc-track", "--export-blocklist", str(block), "--min-blamed", "2")
    entries = json.loads(block.read_text())["samples"]
    assert [(e["sample_id"], e["index"], e["metadata"]["source"]) for e in entries] == \
        [(junk_fingerprint(bpe_cache), INJECT * 4 + 1, "injected:garbled_span")]
    proc = demo_run(root, bpe_cache, "train.seed=0", "run_name=blocked", f"data.blocklist={block}")
    run_dir = run_dir_of(proc)
    summary = summary_of(run_dir)
    assert [(o["step"], o["sample"], o["sample_id"], o["why"]) for o in summary["left_out"]] == \
        [(INJECT, 1, entries[0]["sample_id"], "blocklist")]
    assert INJECT not in summary["events_at"] and summary["blocklist_dropped"] == 1
    out = proc.stdout + proc.stderr
    assert f"step {INJECT}: left out sample 1 (blocklist: sample_id {entries[0]['sample_id']})" in out
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run_id = json.loads((run_dir / "tracker" / "mlflow.json").read_text())["view"]["run_id"]
    dropped = {m.step: m.value for m in client.get_metric_history(run_id, "data/blocklist_dropped")}
    assert dropped[INJECT] == 1.0 and all(v == 0.0 for st, v in dropped.items() if st < INJECT)
    assert client.get_run(run_id).data.params["data.blocklist"] == str(block)


def test_the_ledger_logs_itself_to_mlflow_as_a_table(two_runs):
    root, _ = two_runs
    doc = ledger(root, "gradloc-track", "--by", "source", "--log-to", "mlflow", "--experiment", "ledgers")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("ledgers").experiment_id])
    assert run.info.run_name == "culprit-ledger" and run.info.status == "FINISHED"
    local = Path(client.download_artifacts(run.info.run_id, "ledger", str(root / "dl")))
    table = read_table(local.parent, "ledger/samples")
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [(r["sample_id"], r["blamed"]) for r in rows] == [(s["sample_id"], s["blamed"]) for s in doc["samples"]]
    assert read_table(local.parent, "ledger/by_source")["data"] and (local / "culprits.html").is_file()


def test_quarantine_skips_a_blamed_document_when_it_comes_again(tmp_path, bpe_cache):
    # the same garbled answer at steps 100 and 102: blamed at 100, skipped (and logged) at 102
    proc = demo_run(tmp_path, bpe_cache, "train.inject.every=2", "spikes.quarantine=true", "tracker=none")
    summary = summary_of(run_dir_of(proc))
    assert INJECT in summary["events_at"] and INJECT + 2 not in summary["events_at"]
    assert [(o["step"], o["sample"], o["why"]) for o in summary["left_out"]] == [(INJECT + 2, 1, "quarantine")]
    assert summary["quarantine_skipped"] == 1
    lines = [json.loads(ln) for ln in (run_dir_of(proc) / "metrics.jsonl").read_text().splitlines()]
    skipped = {ln["step"]: ln["metrics"]["data/quarantine_skipped"] for ln in lines
               if "data/quarantine_skipped" in ln["metrics"]}
    assert skipped[INJECT + 2] == 1.0 and skipped[0] == 0.0


@pytest.mark.parametrize("content, says", [(None, "use the path of a file written by"),
                                           ("{not json", "not JSON"),
                                           ('{"format": "other"}', "not a blocklist")])
def test_a_bad_blocklist_fails_naming_data_blocklist(tmp_path, bpe_cache, content, says):
    path = tmp_path / "block.json"
    if content is not None:
        path.write_text(content)
    proc = demo_run(tmp_path, bpe_cache, f"data.blocklist={path}", check=False)
    assert proc.returncode != 0
    assert f"data.blocklist={str(path)!r} is invalid" in proc.stderr and says in proc.stderr
    assert "Traceback" not in proc.stderr
