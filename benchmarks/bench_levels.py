"""What the localizer's levels cost and find (issue 16): many culprits, levels, replay with dropout.

1. Many culprits: heavy terms (loss weight 60) scattered among N terms of a tiny GPT; recall, false
   positives and probes of ``auto`` (budget 128) and ``bisect`` (budget 4N), over seeds. The
   threshold of 0.2 (10x the batch's own 90th percentile) is printed beside ours.
2. Levels: probes spent and what is named for a whole bad document (each term below the token
   threshold), a bad stretch in a long sample, a few heavy tokens, a document in a packed row, a
   step no sample explains, and issue 28's two coherent cases (a sample with a few hotter terms;
   a stretch whose first terms are much hotter).
3. Replay: a step of 4 micro-batches of a tiny HF GPT-2 (dropout 0.1 and 0): the sum of the
   full-mask probes against the step's gradient, replaying one RNG state for every micro-batch
   (0.2) and one per micro-batch (0.3).
4. HF Trainer (issue 28): Llama, Qwen2 (attention dropout 0 and 0.1) and GPT-2 (dropout 0.1),
   random init, 2 steps of 4 micro-batches of 2, one coherent garbage document at the last step
   (``tests/localizer/test_levels_models.py``'s case), with Trainer's clipping off and at its
   default ``max_grad_norm=1.0``: the row named (level, micro-batch, sample, dataset index,
   sample_id), its share, the probes, and the step check's norm ratio (1: the pre-clip gradient).

``python benchmarks/bench_levels.py [--only hf]`` (about a minute on 2 CPU cores).
"""
from __future__ import annotations

import math
import time
import warnings

import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.demo.model import TinyGPT
from gradloc_track.localizer.ghost import GhostMap

V = 64


def tiny(T: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T, dropout=0.0)


def weighted_loss(model, B: int, T: int, w: torch.Tensor, seed: int = 0, same: int | None = None):
    """``same``: that sample is one token predicting one token everywhere (coherent terms)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    if same is not None:
        x[same], y[same] = 7, 9

    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)
    return loss_fn


def old_threshold(model, loss_fn, shape) -> float:
    """0.2's rule: 10x the 90th percentile of the ghost term scores."""
    with GhostMap(model, "block", shape) as gm:
        model.zero_grad(set_to_none=True)
        loss_fn(torch.ones(shape)).backward()
    layer_map, _ = gm.result([])
    model.zero_grad(set_to_none=True)
    return float(10 * torch.quantile(layer_map.pow(2).sum(0).sqrt().flatten().double(), 0.9))


def many_culprits(seeds: int = 3) -> None:
    print("\n1. many culprits (weight 60): found / FP / probes, mean over seeds")
    print("| N | m | 0.2 threshold / ours | auto found | auto FP | auto probes | bisect found | bisect FP | "
          "bisect probes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, T, m in ((4, 16, 10), (8, 32, 32), (16, 64, 100)):
        rows = []
        for seed in range(seeds):
            g = torch.Generator().manual_seed(100 + seed)
            cells = {(i // T, i % T) for i in torch.randperm(B * T, generator=g)[:m].tolist()}
            w = torch.ones(B, T)
            for c in cells:
                w[c] = 60.0
            model = tiny(T)
            fn = weighted_loss(model, B, T, w, seed)
            row = [old_threshold(model, fn, (B, T))]
            for method, budget in (("auto", 128), ("bisect", 4 * B * T)):
                r = gradloc_track.locate(model, fn, torch.ones(B, T), method=method, budget=budget)
                found = {(c.batch, c.position) for c in r.tokens}
                row += [len(found & cells), len(found - cells), r.probes, r.threshold]
            rows.append(row)
        mean = [sum(r[j] for r in rows) / len(rows) for j in range(len(rows[0]))]
        print(f"| {B * T} | {m} | {mean[0]:.3g} / {mean[4]:.3g} | {mean[1]:.1f} | {mean[2]:.1f} | {mean[3]:.1f} | "
              f"{mean[5]:.1f} | {mean[6]:.1f} | {mean[7]:.1f} |")


def level_cases() -> None:
    print("\n2. levels: probes and what is named (tiny GPT, B=8, T=32 unless said)")
    print("| case | probes | culprits (level: micro_batch/sample/positions) | seconds |")
    print("|---|---|---|---|")
    B, T = 8, 32

    def run(name, w, threshold=None, docs=None, shape=(B, T), same=None):
        model = tiny(shape[1])
        fn = weighted_loss(model, *shape, w, same=same)
        model.zero_grad(set_to_none=True)
        fn(torch.ones(shape)).backward()  # the step's gradient in .grad, as in training
        if callable(threshold):
            threshold = threshold(model, fn, shape)
        t0 = time.perf_counter()
        r = gradloc_track.locate(model, fn, torch.ones(shape), threshold=threshold, document_ids=docs)
        dt = time.perf_counter() - t0
        named = ", ".join(f"{c.level}: {c.batch}/{c.start}-{c.end - 1} ({c.share:.2f})" if c.level != "token"
                          else f"token {c.batch}/{c.position} ({c.share:.2f})" for c in r.culprits) \
            or "none (shares noted)"
        print(f"| {name} | {r.probes} | {named} | {dt:.2f} |")

    w = torch.ones(B, T)
    w[5] = 20.0
    run("whole document, adaptive threshold", w)
    run("whole document, explicit threshold=5", w, threshold=5.0)
    w = torch.ones(4, 64)
    w[2, 20:28] = 25.0
    run("bad stretch of 8 in a 64-long sample, threshold=5", w, threshold=5.0, shape=(4, 64))
    w = torch.ones(B, T)
    w[3, 4] = w[3, 15] = 60.0
    run("two heavy tokens in one sample", w)
    w = torch.ones(B, T)
    w[1, 10:22] = 25.0
    run("document 1 of a packed row, threshold=5", w, threshold=5.0, docs=_docs(B, T))
    run("nothing stands out", torch.ones(B, T))
    coherent_cases(run, B, T)


def _docs(B: int, T: int) -> torch.Tensor:
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[1, 10:22], docs[1, 22:] = 1, 2
    return docs


def coherent_cases(run, B: int, T: int) -> None:
    """Issue 28: a sample whose terms add up coherently (one token predicting one token at every
    position) with a few hotter terms holding most of its per-term mass; and a coherent stretch
    whose first three terms are much hotter than the rest (the span must not shrink onto them).
    The threshold sits between the ordinary coherent terms and the hotter ones (1.5x the largest
    exact norm of the former)."""
    w = torch.ones(B, T)
    w[5] = 6.0
    hot = [3, 9, 14, 20]
    w[5, hot] = 20.0
    run("coherent sample, 4 hotter terms (60% of its per-term mass)", w, same=5,
        threshold=between([(5, t) for t in range(T) if t not in hot]))
    w = torch.ones(4, 48)
    w[2, 8:24] = 8.0
    w[2, 8:11] = 40.0
    run("coherent stretch 8-23 of 48, its first 3 terms 5x hotter", w, same=2, shape=(4, 48),
        threshold=between([(2, t) for t in range(11, 24)]))


def between(cells):
    """A threshold 1.5x the largest exact single-term norm over ``cells`` (a backward each)."""
    def tau(model, fn, shape):
        params = [p for p in model.parameters() if p.requires_grad]
        norms = []
        for b, t in cells:
            m = torch.zeros(shape)
            m[b, t] = 1.0
            gs = torch.autograd.grad(fn(m), params, allow_unused=True)
            norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in gs if g is not None)))
        return 1.5 * max(norms)
    return tau


def replay() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradloc_track.integrations.batches import MicroBatchCapture, lm_spike_context

    print("\n3. replay: 4 micro-batches x (2, 16), HF GPT-2; sum of full-mask probes vs the step's .grad")
    print("| dropout | RNG replayed | step norm | probes' sum norm | residual |")
    print("|---|---|---|---|---|")
    for p in (0.1, 0.0):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                           resid_pdrop=p, embd_pdrop=p, attn_pdrop=p))
        g = torch.Generator().manual_seed(0)
        mbs = [torch.randint(0, V, (2, 16), generator=g) for _ in range(4)]
        cap = MicroBatchCapture(model)
        model.train()
        for x in mbs:
            (model(input_ids=x, labels=x).loss / 4).backward()
        batches, rng = cap.take()
        cap.remove()
        step = math.sqrt(sum(float(q.grad.double().pow(2).sum()) for q in model.parameters()))
        for label, states in (("one state (0.2)", [rng[0]] * 4), ("one per micro-batch", rng)):
            ctx = lm_spike_context(model, batches, rng_state=states)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = gradloc_track.locate(model, ctx.loss_fn, ctx.token_mask, rng_state=ctx.rng_state)
            print(f"| {p} | {label} | {step:.5f} | {r.total_norm:.5f} | {r.step_check.residual:.2e} |")


def hf_models() -> None:
    from transformers import Trainer, TrainingArguments

    from gradloc_track import MemoryTracker
    from gradloc_track.integrations.hf import GradLocCallback, keep_columns, with_index
    from tests.localizer.test_levels_models import B, K, STEPS, dataset, model_of

    print("\n4. HF Trainer, one coherent garbage document (micro-batch 3, sample 1, dataset index "
          f"{(STEPS - 1) * B + 3 * (B // K) + 1}) at step {STEPS}")
    print("| model | max_grad_norm | rows named | sample_id | share | probes | .grad / probes' sum |")
    print("|---|---|---|---|---|---|---|")
    for kind, dropout in (("llama", 0.0), ("qwen2", 0.0), ("qwen2", 0.1), ("gpt2", 0.1)):
        for clip in (0.0, 1.0):
            model, tracker = model_of(kind, dropout), MemoryTracker()
            cb = GradLocCallback(spikes={"mode": "fixed", "per_token_threshold": 1e-6, "warmup_steps": STEPS - 1},
                                 tracker=tracker, log_every=1000)
            args = TrainingArguments(
                output_dir="/tmp/bench_levels_hf", per_device_train_batch_size=B // K,
                gradient_accumulation_steps=K, max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant",
                report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                seed=0, max_grad_norm=clip, train_sampling_strategy="sequential", logging_steps=1000,
                remove_unused_columns=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Trainer(model=model, args=args, train_dataset=with_index(dataset()),
                        data_collator=keep_columns(model, "dataset_index"), callbacks=[cb]).train()
            (stats,) = [st for st in cb.handle.spikes if st.step == STEPS]
            res = stats.locate
            table = tracker.tables["spikes/tokens"]
            cells = [dict(zip(table["columns"], r)) for r in table["rows"]]
            named = "; ".join(f"{c['level']} mb {c['micro_batch']} sample {c['sample']} index {c['dataset_index']}"
                              for c in cells)
            ids = ", ".join(str(c.get("sample_id")) for c in cells)
            shares = ", ".join(f"{c.share:.3f}" for c in res.culprits)
            print(f"| {kind} (dropout {dropout}) | {clip} | {named} | {ids} | {shares} | {res.probes} | "
                  f"{res.step_check.norm_ratio:.4f} |")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["many", "levels", "replay", "hf"], default=None)
    only = ap.parse_args().only
    torch.set_num_threads(1)
    for name, fn in (("many", many_culprits), ("levels", level_cases), ("replay", replay), ("hf", hf_models)):
        if only in (None, name):
            fn()
