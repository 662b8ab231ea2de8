"""The console output README.md and docs/*.md quote is what the runs print today (``tests/docs/snippets.py``;
``python -m tests.docs.snippets`` rewrites the marked blocks), and the demo's facts the ledger page cites
(the culprit sample, its dataset index) are the demo's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ..examples.demo_run import demo_run
from . import snippets
from .snippets import ROOT, Runs, blocks, facts, normalize, rewrite, same, stale

_TRL: dict = {}


def session_runs(tmp_path_factory) -> Runs:
    def trl():
        if "run" not in _TRL:
            _TRL["run"] = snippets.run_trl_example(tmp_path_factory.mktemp("trl_grpo"))
        return _TRL["run"]

    return Runs(lambda: demo_run(tmp_path_factory), trl)


def test_every_marked_block_is_known_and_each_snippet_is_quoted():
    found = {name for path in snippets.DOCS for name, _ in blocks(path)}
    assert found == set(snippets.SNIPPETS), f"quoted: {sorted(found)}, generated: {sorted(snippets.SNIPPETS)}"
    found = {name for path in snippets.DOCS for name, _ in facts(path)}
    assert found == set(snippets.FACTS), f"quoted: {sorted(found)}, generated: {sorted(snippets.FACTS)}"


def test_a_full_precision_float_may_move_in_its_last_digits_a_rounded_number_may_not():
    """Issue 40: the ledger page's blocklist quotes max_share as the JSON file has it, 16 digits, of which the last
    ones move with the CPU's vector kernels (AVX-512 vs SSE4.1); a console's rounded 90% or z = 7 does not."""
    assert same('"max_share": 0.9041699414420074', '"max_share": 0.9041701832207513')
    assert not same('"max_share": 0.9041699414420074', '"max_share": 0.9141699414420074')  # a real change
    assert not same("(90% of the batch)", "(91% of the batch)") and not same("z = 7", "z = 8")
    assert not same("clipped 3% of 80 steps", "clipped 3% of 81 steps") and same("z = 7", "z = 7")
    assert not same('"max_share": 0.9041699414420074', '"min_share": 0.9041699414420074')


def test_a_fact_in_the_prose_is_checked_and_rewritten_and_a_rewrite_keeps_what_still_holds(tmp_path, monkeypatch):
    monkeypatch.setitem(snippets.FACTS, "demo-threshold", lambda runs: "2.60 before step 100")
    monkeypatch.setitem(snippets.SNIPPETS, "demo-blocklist", lambda runs: '"max_share": 0.9041701832207513\n')
    doc = tmp_path / "doc.md"
    doc.write_text("the threshold is <!-- fact: demo-threshold -->2.42 before step 100<!-- /fact -->.\n"
                   "<!-- snippet: demo-blocklist -->\n```json\n\"max_share\": 0.9041699414420074\n```\n"
                   "<!-- /snippet -->\n")
    runs = Runs(lambda: None, lambda: None)
    assert stale(runs, [doc]) == ["doc.md: demo-threshold"]
    assert rewrite(runs, [doc]) and stale(runs, [doc]) == []
    text = doc.read_text()
    assert "<!-- fact: demo-threshold -->2.60 before step 100<!-- /fact -->." in text
    assert '"max_share": 0.9041699414420074' in text  # the quoted digits kept: they say the same


def test_a_quoted_number_that_no_longer_holds_fails_and_rewrite_fixes_it(tmp_path):
    """The machinery on a doc of its own: a block whose text the run no longer prints is stale, rewrite
    puts the run's text in, and then nothing is stale."""
    root = tmp_path / "run"
    console = (f"[ 10/130] step   9  loss 5.1  grad norm 1\n── spike at step 100 ──\n"
               f"  culprits   sample 3, tokens 40-42: "
               f"'x'  (89% of the batch's squared grad norm)\n"
               f"  artifacts  MLflow run demo 11-25 17:36:05 ({'a' * 32}): "
               f"http://127.0.0.1:5000/#/experiments/7/runs/{'a' * 32}\ndone: 130 steps in 151 s\n"
               f"  gradloc-track report {root}/runs/2026-11-25_17-39-28_885223 -o spike_report.html\n")
    runs = Runs(lambda: SimpleNamespace(console=console, root=root), lambda: None)
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- snippet: demo-console -->\n```text\n── spike at step 100 ──\n  culprits   sample 3, "
                   "tokens 40-42: 'x'  (91% of the batch's squared grad norm)\n```\n<!-- /snippet -->\nend\n")
    assert stale(runs, [doc]) == ["doc.md: demo-console"]
    assert rewrite(runs, [doc]) and stale(runs, [doc]) == []
    text = doc.read_text()
    assert "(89% of" in text and "step   9" not in text and text.endswith("<!-- /snippet -->\nend\n")
    assert "MLflow run demo <time> (<run id>): http://127.0.0.1:5000/#/experiments/<id>/runs/<run id>" in text
    assert "done: 130 steps in <s> s" in text and "gradloc-track report runs/<date> -o spike_report.html" in text
    assert normalize(f"sqlite:///{root}/mlflow.db", root) == "sqlite:///<the folder you ran it from>/mlflow.db"


@pytest.mark.slow
def test_the_docs_quote_what_the_demo_prints(tmp_path_factory):
    runs = session_runs(tmp_path_factory)
    demo_docs = [p for p in snippets.DOCS if any(n.startswith("demo-") for n, _ in blocks(p) + facts(p))]
    assert Path(ROOT / "README.md") in demo_docs and Path(ROOT / "docs" / "forensics.md") in demo_docs
    assert stale(runs, demo_docs) == [], "python -m tests.docs.snippets rewrites them from fresh runs"
    # the ledger page's prose cites the demo's culprit: its sample (the injected one) and its dataset index
    import json

    (row,) = json.loads(snippets.demo_blocklist(runs))["samples"]
    ledger = (ROOT / "docs" / "ledger.md").read_text(encoding="utf-8")
    assert "left out sample 3" in ledger and f"`dataset_index` {row['index']}" in ledger


@pytest.mark.slow
def test_the_trl_page_quotes_what_the_grpo_example_prints(tmp_path_factory):
    runs = session_runs(tmp_path_factory)
    trl = [p for p in snippets.DOCS if any(n.startswith("trl-") for n, _ in blocks(p))]
    assert stale(runs, trl) == [], "python -m tests.docs.snippets rewrites them from fresh runs"


def test_the_regeneration_command_runs_from_the_repository_root():
    """``python -m tests.docs.snippets --help``-free check: the module imports as the docs say to run it."""
    proc = subprocess.run([sys.executable, "-c", "import tests.docs.snippets as s; print(len(s.SNIPPETS))"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(len(snippets.SNIPPETS)), proc.stderr
