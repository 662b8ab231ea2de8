"""sft: SFTTrainer's loss rebuilt with its fixed normaliser, packed documents from position-id restarts,
and the setups it does not rebuild named with a reason."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gradloc_track.integrations.batches import LMBatch
from gradloc_track.integrations.trl.sft import SFTMicroBatch, document_map, make_loss_fn, unsupported


def test_document_map_follows_position_id_restarts_one_position_ahead():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    # term t scores token t+1: the last term of a document scores the next document's first token
    assert document_map(pos).tolist() == [[0, 0, 1, 1, 2, 2, 2, 2]]
    assert document_map(torch.tensor([[3, 4, 5]])).tolist() == [[0, 0, 0]]  # a row starting mid-document


def args(**kw):
    return SimpleNamespace(args=SimpleNamespace(loss_type=kw.pop("loss_type", "nll")),
                           accelerator=SimpleNamespace(parallelism_config=kw.pop("pc", None)), **kw)


def test_unsupported_setups_each_say_why():
    assert unsupported(args()) is None
    assert "compute_loss_func" in unsupported(args(compute_loss_func=lambda *a: 0))
    assert "label smoothing" in unsupported(args(label_smoother=object()))
    assert "loss_type='chunked'" in unsupported(args(loss_type="chunked"))
    assert "load-balancing" in unsupported(args(aux_loss_enabled=True))
    assert "sequence/context" in unsupported(args(pc=SimpleNamespace(sp_enabled=True)))
    assert "multimodal" in unsupported(args(), {"pixel_values": torch.zeros(1)})


class Tiny(torch.nn.Module):
    def __init__(self, V=11, d=8):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(V, d), torch.nn.Linear(d, V)

    def forward(self, input_ids, position_ids=None, use_cache=None, attention_mask=None):
        h = self.emb(input_ids)
        if position_ids is not None:
            h = h + 0.1 * position_ids.unsqueeze(-1).float()
        return SimpleNamespace(logits=self.head(torch.tanh(h)))


@pytest.mark.parametrize("dft", [False, True])
def test_the_rebuilt_loss_is_trls_sum_over_num_items_and_adds_up(dft):
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.randint(1, 11, (2, 6))
    labels = ids.clone()
    labels[0, :2] = -100
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    mb = SFTMicroBatch(LMBatch(ids, labels, None), {"input_ids": ids, "position_ids": pos}, num_items=7,
                       scale=1.0, dft=dft, rng={})
    loss_fn = make_loss_fn(model, mb)
    full = loss_fn(torch.ones(2, 6))
    logits = model(ids, position_ids=pos).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none")
    if dft:
        nll = nll * torch.exp(-nll).detach()
    assert full.detach().item() == pytest.approx(float(nll.sum() / 7), rel=1e-6)
    keep = torch.zeros(2, 6)
    keep[1] = 1
    assert (loss_fn(keep) + loss_fn(1 - keep)).detach().item() == pytest.approx(full.detach().item(), rel=1e-6)
    assert mb.documents().tolist() == [[0, 0, 1, 1, 1, 1], [0] * 6]
