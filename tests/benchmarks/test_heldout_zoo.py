"""The held-out zoo (benchmarks/heldout_zoo.py): its split is well formed, its injections write what
they say, culprit rows are matched at their level, and one tiny scenario runs and scores."""
from __future__ import annotations

import pytest
import torch

from .test_bench_surgery import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("heldout_zoo")  # puts benchmarks/ on the path


def test_split_holds_every_kind_of_failure_in_both_halves_and_the_unseen_sources_held_out(bench):
    from zoo import split

    halves = {h: split.runs(h) for h in (split.DEV, split.HELDOUT)}
    assert sorted(halves[split.DEV] + halves[split.HELDOUT]) == sorted(split.RUNS)  # each run in one half
    for h, runs in halves.items():
        causes = {split.KINDS[k].causes[0] for _, _, k in runs if split.KINDS[k].causes}
        assert causes == {"data", "schedule", "numeric", "off_policy"}, h
        assert {f for f, _, _ in runs} == set(split.FAMILIES), h  # every front door in both halves
        assert any(k == "clean" for _, _, k in runs)
    held_sources = {s for _, s, _ in halves[split.HELDOUT]}
    assert {s for s, h in split.SOURCES.items() if h == split.HELDOUT} <= held_sources
    # dev sees the spike zoo's corpus and, since stop 59, sources of the held-out shapes from other files
    assert {s for _, s, _ in halves[split.DEV]} == {"pydoc", "c_headers", "changelogs", "mixed_docs", "perl"}
    for kind in ("three_identical_junk", "base64_blob", "packed_junk_doc", "eight_tokens", "cosine_restart",
                 "weight_bitflip", "labels_leaked", "stale_tokens", "garbage_completion"):
        assert split.KINDS[kind].half == split.HELDOUT and all(k != kind for _, _, k in halves[split.DEV])
    todo = bench.groups([split.HELDOUT], ["loop", "grpo"])  # what a pass runs: twins first, placebos added
    assert todo[("loop", "python")][0] == "clean" and todo[("loop", "python")][-2:] == ["placebo", "placebo_labels"]
    assert todo[("grpo", "licences")] == ["clean", "stale_tokens", "garbage_completion"]
    assert split.half("demo", "pydoc", "garbled_tokens") == split.DEV  # the spike zoo is dev whole
    assert split.half("loop", "python", "two_random_samples") == split.HELDOUT  # a held-out source
    assert split.half("loop", "pydoc", "cosine_restart") == split.HELDOUT  # a held-out kind
    assert split.half("llama", "licences", "placebo_labels") == split.HELDOUT
    with pytest.raises(ValueError, match="source='web' is not in the split: use one of pydoc"):
        split.half("loop", "web", "clean")
    with pytest.raises(ValueError, match="kind='typo' is not in the split"):
        split.half("loop", "pydoc", "typo")


def _batch(B=8, T=32, docs=None):
    from zoo.demo import Batch

    r = torch.arange(B * (T + 1)).view(B, T + 1) % 50 + 100
    return Batch(r[:, :-1].clone(), r[:, 1:].clone(), torch.ones(B, T), docs)


def test_injections_change_what_their_truth_names(bench):
    from zoo import kinds, split

    space = kinds.Space(256, lambda t: list(t.encode("ascii")))
    clean = _batch()
    b = _batch()
    truth = kinds.inject("three_identical_junk", b, 150, 0, space)
    hit = sorted(u["batch"] for u in truth)
    changed = [k for k in range(8) if not torch.equal(b.y[k], clean.y[k])]
    assert len(hit) == 3 and changed == hit and torch.equal(b.y[hit[0]], b.y[hit[2]])  # the same junk
    assert all(torch.equal(b.x[k, 1:], b.y[k, :-1]) for k in range(8))  # rows stay rows: x and y agree
    b = _batch()
    (span,) = kinds.inject("base64_blob", b, 150, 0, space)
    k, lo, hi = span["batch"], span["start"], span["end"]
    diff = (b.y[k] != clean.y[k]).nonzero().flatten().tolist()
    assert span["level"] == "span" and lo <= diff[0] and diff[-1] < hi and hi - lo == 16  # half the row
    b = _batch(B=64, T=16)
    truth = kinds.inject("eight_tokens", b, 150, 0, space)
    assert len({u["batch"] for u in truth}) == 8 and float(b.weights.sum()) == 64 * 16 + 8 * 63
    assert all(b.weights[u["batch"], u["start"]] == 64 for u in truth)
    b = _batch(B=64, T=16)  # the dev sibling (stop 60): four terms
    assert len({u["batch"] for u in kinds.inject("four_tokens", b, 150, 0, space)}) == 4
    assert split.KINDS["four_tokens"].half == split.DEV
    b = _batch()
    truth = kinds.inject("labels_leaked", b, 150, 0, space)
    assert all(torch.equal(b.y[u["batch"]], b.x[u["batch"]]) for u in truth) and len(truth) == 3
    assert kinds.inject("lr_x50", _batch(), 150, 0, space) == []


def test_packed_junk_document_is_its_own_document(bench):
    from zoo import kinds
    from zoo.streams import PackedRows

    docs = [torch.full((n,), 10 + i) for i, n in enumerate((300, 700, 2000, 500, 260))]
    b = PackedRows(docs, 1024, 2, seed=0).clean(5)
    assert b.x.shape == (2, 1024) and int(b.docs.max()) >= 1
    (unit,) = kinds.inject("packed_junk_doc", b, 5, 0, kinds.Space(64, lambda t: []))
    k, d = unit["batch"], unit["document"]
    where = (b.docs[k] == d).nonzero().flatten()
    assert unit["level"] == "document" and len(where) == kinds.PACKED_JUNK
    assert int(where[-1] - where[0]) == kinds.PACKED_JUNK - 1  # one contiguous segment


def test_culprit_rows_are_matched_at_their_level(bench):
    from zoo import culprits

    sample = {"level": "sample", "batch": 3, "start": 0, "end": 64, "document": None}
    token = {"level": "token", "batch": 3, "start": 9, "end": 10, "document": None}
    span = {"level": "span", "batch": 3, "start": 20, "end": 44, "document": None}
    doc = {"level": "sample", "batch": 1, "start": 100, "end": 500, "document": 2}
    assert culprits.named([{"level": "sample", "batch": 3}], [sample]) == (1, 1)
    assert culprits.named([{"level": "token", "batch": 3, "start": 9, "end": 10}], [sample]) == (0, 1)  # too coarse
    assert culprits.named([{"level": "token", "batch": 3, "start": 9, "end": 10}], [token]) == (1, 1)
    assert culprits.named([{"level": "span", "batch": 3, "start": 16, "end": 48}], [span]) == (1, 1)
    assert culprits.named([{"level": "span", "batch": 3, "start": 16, "end": 48}], [sample]) == (0, 1)
    assert culprits.named([{"level": "document", "batch": 1, "document": 2}], [doc]) == (1, 1)
    assert culprits.named([{"level": "document", "batch": 1, "document": 3}], [doc]) == (0, 1)
    assert culprits.named([{"level": "sample", "batch": 3}, {"level": "sample", "batch": 5}], [sample]) == (1, 2)
    assert culprits.twice([sample, dict(sample), token]) == 1


@pytest.mark.filterwarnings("ignore")
def test_one_tiny_scenario_runs_scores_and_rescores(bench, tmp_path):
    from zoo import halves, loop, snapshots

    s = loop.LoopSetting(family="loop", source="pydoc", n_layer=1, n_head=2, d_model=16, seq_len=32, steps=60,
                         clean_steps=60, eval_batches=1, detector={"warmup_steps": 10}, snapshots=str(tmp_path))
    runs = [loop.run(kind, 0, s) for kind in ("two_random_samples", "placebo", "clean")]
    scen = runs[0]
    assert scen.injected_steps == [30, 40, 50] and len(scen.harms) == 3  # schedule.THREE scaled to 60 steps
    assert all(len(r.truth) == 2 for r in scen.steps if r.injected) and scen.placebo == "placebo"
    table = halves.render(runs)
    assert "| dev | loop | pydoc | two_random_samples |" in table and "| dev | loop | pydoc | 60 |" in table
    # --replay --rescore: this code's detector fed the recorded inputs fires where the live one did
    assert halves.render(runs, bench.rescorer({"warmup_steps": 10})) == table
    saved = sorted(tmp_path.glob("*.pt"))
    assert len(saved) == 3  # the injected steps, for the localizer alone
    model, ctx = loop.replay(snapshots.load(saved[0]))
    rows, res = snapshots.locate_rows(model, ctx)
    assert res.step_check is not None and res.step_check.replayed  # the replay is the step that was trained
