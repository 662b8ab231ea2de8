"""``filter_dataset`` on an HF dataset in every format, and the torch wrappers by index, against the
records picked by hand (the blocked ones are known by position)."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.artifacts.identity import sample_fingerprint
from gradloc_track.data import BlockedDataset, filter_dataset, load_blocklist, write_blocklist

N = 6
BLOCKED = (1, 4)  # positions of the blocked records


def records() -> list[dict]:
    return [{"input_ids": [1, 2, 3 + i, 4 + i], "labels": [-100, -100, 3 + i, 4 + i], "dataset_index": 100 + i}
            for i in range(N)]


@pytest.fixture
def block(tmp_path):
    recs = records()
    return load_blocklist(write_blocklist(tmp_path / "b.json", [
        {"sample_id": sample_fingerprint([t for t in recs[i]["labels"][1:] if t != -100]),
         "index": recs[i]["dataset_index"]} for i in BLOCKED]))


@pytest.mark.parametrize("fmt", [None, "torch", "numpy", "arrow", "pandas"])
@pytest.mark.parametrize("by", ["index", "fingerprint"])
def test_every_hf_format_drops_the_blocked_records_and_keeps_its_format(block, fmt, by):
    from datasets import Dataset

    ds = Dataset.from_list(records()).with_format(fmt)
    kept, dropped = filter_dataset(ds, block, by=by)
    assert dropped == len(BLOCKED) and len(kept) == N - len(BLOCKED)
    assert kept.format["type"] == fmt  # handed back as it came
    left = kept.with_format(None)["dataset_index"]
    assert left == [100 + i for i in range(N) if i not in BLOCKED]


def test_hf_format_columns_are_kept(block):
    from datasets import Dataset

    ds = Dataset.from_list(records()).with_format("torch", columns=["input_ids"])
    kept, dropped = filter_dataset(ds, block, by="index")  # the index column is hidden by the format
    assert dropped == 2 and kept.format["columns"] == ["input_ids"] and isinstance(kept[0]["input_ids"], torch.Tensor)


def test_torch_records_match_by_index(block):
    tensors = [{"dataset_index": torch.tensor(r["dataset_index"]), "x": torch.tensor(r["input_ids"])}
               for r in records()]
    ds = BlockedDataset(tensors, block, by="index")
    assert ds.dropped == 2 and [int(ds[i]["dataset_index"]) for i in range(len(ds))] == [100, 102, 103, 105]


def test_an_index_column_that_holds_no_index_is_a_clear_error(block):
    with pytest.raises(ValueError, match="index_column='dataset_index' holds a list"):
        BlockedDataset([{"dataset_index": [1, 2]}], block, by="index")
    from datasets import Dataset

    with pytest.raises(ValueError, match="one record at a time"):
        filter_dataset(Dataset.from_list(records()), block, batched=True)


def test_a_string_index_in_the_blocklist_drops_the_integer_records(tmp_path):
    from datasets import Dataset

    block = load_blocklist(write_blocklist(tmp_path / "s.json", [{"sample_id": f"{i:016x}", "index": str(100 + i)}
                                                                  for i in BLOCKED]))
    kept, dropped = filter_dataset(Dataset.from_list(records()), block, by="index")
    assert dropped == 2 and kept["dataset_index"] == [100, 102, 103, 105]
    tensors = [{"dataset_index": torch.tensor(r["dataset_index"])} for r in records()]
    assert BlockedDataset(tensors, block, by="index").dropped == 2
