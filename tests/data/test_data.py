"""gradloc_track.data: blocklist files, the HF ``Dataset`` filter, the torch wrappers and the
quarantine, each checked against fingerprints computed independently (``sample_fingerprint`` of
the loss-bearing ids, as the culprit table computes ``sample_id``)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gradloc_track.artifacts.identity import sample_fingerprint
from gradloc_track.artifacts.table import attribution_table
from gradloc_track.data import (BlockedDataset, BlockedIterableDataset, BlocklistError, Quarantine, filter_dataset,
                                load_blocklist, record_fingerprint, write_blocklist)
from gradloc_track.localizer.result import CulpritToken, LocateResult


def records(n: int = 6) -> list[dict]:
    """HF-style records: labels with a masked prompt (-100), one record per distinct text."""
    return [{"input_ids": [1, 2, 3 + i, 4 + i], "labels": [-100, -100, 3 + i, 4 + i], "dataset_index": 10 + i,
             "source": "web" if i != 2 else "forum"} for i in range(n)]


def loss_ids(rec: dict) -> list[int]:
    return [t for t in rec["labels"][1:] if t != -100]


def blocklist_of(tmp_path, *recs: dict, index: bool = True):
    path = write_blocklist(tmp_path / "b.json", [{"sample_id": sample_fingerprint(loss_ids(r)),
                                                  "index": r["dataset_index"] if index else None} for r in recs])
    return load_blocklist(path)


def test_hf_dataset_filter_drops_by_fingerprint_or_index_with_a_count(tmp_path):
    from datasets import Dataset

    recs = records()
    ds = Dataset.from_list(recs)
    block = blocklist_of(tmp_path, recs[2], recs[4])
    kept, dropped = filter_dataset(ds, block)
    assert dropped == 2 and kept["dataset_index"] == [10, 11, 13, 15]
    shuffled = ds.shuffle(seed=0)  # content matches wherever the record went
    assert sorted(filter_dataset(shuffled, block)[0]["dataset_index"]) == [10, 11, 13, 15]
    kept, dropped = filter_dataset(ds, block, by="index")
    assert dropped == 2 and kept["source"] == ["web"] * 4
    with pytest.raises(TypeError, match="BlockedDataset"):
        filter_dataset([1, 2], block)


def test_torch_wrappers_drop_blocked_samples_and_count_them(tmp_path):
    recs = records()
    block = blocklist_of(tmp_path, recs[1], index=False)
    ds = BlockedDataset(recs, block)
    assert (len(ds), ds.dropped) == (5, 1) and [ds[i]["dataset_index"] for i in range(5)] == [10, 12, 13, 14, 15]
    by_pos = BlockedDataset([{"x": i} for i in range(4)], load_blocklist(write_blocklist(
        tmp_path / "i.json", [{"sample_id": "0" * 16, "index": [0, 3]}])), by="index")
    assert [by_pos[i]["x"] for i in range(len(by_pos))] == [1, 2] and by_pos.dropped == 2
    seen = []
    stream = BlockedIterableDataset(iter(recs), block,
                                    on_drop=lambda item, fp: seen.append((item["dataset_index"], fp)))
    assert [r["dataset_index"] for r in stream] == [10, 12, 13, 14, 15]
    assert stream.dropped == 1 and seen == [(11, sample_fingerprint(loss_ids(recs[1])))]
    with pytest.raises(ValueError, match="by='fingerprint'"):
        BlockedDataset(recs, block, by="name")


def test_a_quarantine_skips_in_the_next_epoch_what_this_run_blamed():
    recs = records(3)
    skips = []
    q = Quarantine(on_skip=lambda fp, step, at: skips.append((fp, step, at)))
    epochs = BlockedIterableDataset([r for _ in range(2) for r in recs], q)
    out = []
    for i, r in enumerate(epochs):
        out.append(r["dataset_index"])
        if i == 1:  # a spike at this sample: blamed from now on
            q.blamed[record_fingerprint(r)] = i
    assert out == [10, 11, 12, 10, 12] and epochs.dropped == 1
    assert q.admit(record_fingerprint(recs[1]), step=9) is False and q.skipped == 1
    assert skips == [(record_fingerprint(recs[1]), 9, 1)] and q.admit(record_fingerprint(recs[0])) is True


def test_quarantine_blames_the_samples_the_table_names_with_micro_batches():
    # two micro-batches; culprits: a token of sample 1 in micro-batch 1, a token of sample 0 in micro-batch 0
    ids = [torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), torch.tensor([[9, 9, 9, 9], [4, 3, 2, 1]])]  # K x (B, T)
    mask = [torch.tensor([[1.0, 1, 1, 1], [0, 1, 1, 1]]), torch.tensor([[1.0, 1, 1, 1], [0, 0, 1, 1]])]
    culprits = [CulpritToken(batch=1, position=3, grad_norm=2.0, share=0.6, micro_batch=1),
                CulpritToken(batch=0, position=0, grad_norm=1.0, share=0.2, micro_batch=0)]
    result = LocateResult(tokens=culprits, threshold=1.0, probes=0, method="ghost", total_norm=3.0)
    ctx = SimpleNamespace(input_ids=ids, token_mask=mask, micro_batches=2)
    q = Quarantine()
    found = q.blame(7, result, ctx)
    assert found == sorted([sample_fingerprint([2, 1]), sample_fingerprint([5, 6, 7, 8])])
    cols, rows = attribution_table(7, [], result, ctx)
    assert sorted({r[cols.index("sample_id")] for r in rows}) == found  # what the ledger will list
    assert q.blamed == {fp: 7 for fp in found}
    assert q.blame(8, None, ctx) == [] and len(q) == 2
    # another rank's culprit indexes that rank's batch: a rank's own context blames only its own
    other = LocateResult(tokens=[CulpritToken(batch=0, position=1, grad_norm=1.0, micro_batch=0, rank=1),
                                 CulpritToken(batch=1, position=2, grad_norm=1.0, micro_batch=0, rank=0)],
                         threshold=1.0, probes=0, method="ghost", total_norm=1.0)
    assert Quarantine().blame(3, other, ctx, rank=0) == [sample_fingerprint([2, 3, 4])]


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it"), ("[1, 2", "not JSON"), ('{"samples": []}', "not a blocklist"),
    ('{"format": "gradloc-track-blocklist", "version": 9, "samples": []}', "version 9"),
    ('{"format": "gradloc-track-blocklist", "version": 1, "samples": [{"sample_id": "xyz"}]}',
     "samples[0].sample_id='xyz' is not a 16-hex fingerprint")])
def test_load_blocklist_says_what_is_wrong_naming_the_field(tmp_path, content, says):
    path = tmp_path / "b.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BlocklistError) as err:
        load_blocklist(path, "data.blocklist")
    assert str(err.value).startswith(f"data.blocklist={str(path)!r}: ") and says in str(err.value)


def test_write_blocklist_round_trips_indices_and_metadata(tmp_path):
    path = write_blocklist(tmp_path / "x" / "b.json", [{"sample_id": "0123456789abcdef", "index": [3, 4],
                                                        "metadata": {"source": "forum"}}])
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == ("gradloc-track-blocklist", 1)
    block = load_blocklist(path)
    assert block.blocks(fingerprint="0123456789abcdef") and block.blocks(index=4) and not block.blocks(index=5)
    assert len(block) == 1 and block.read_entries()[0]["metadata"] == {"source": "forum"}
