"""Does the gradient tell a harmful outlier sample from a clean one? A spike zoo side measurement (issue 26).

The per-sample loss signal fires on clean batches that hold an odd window (a table, digits of pi) as
readily as on a bad document. A candidate confirmation would read the step's gradient: a junk sample
should pull against the batch, a clean odd one with it. This script measures that on the demo family
(``zoo/demo.py``'s model, data, optimizer and schedule; no monitor): on every step after 40, the
sample (or packed document) with the largest mean loss, the cosine between its gradient and the rest
of the batch's (plain, and in Adam's metric ``1/(sqrt(v)+eps)``: the update's cosine), its share of
the step's squared gradient norm, and (not the gradient, a candidate too) its excess surprise: its
mean loss minus the model's own entropy there. It prints the injected steps'
values beside the clean steps' spread and the clean steps where the detector fired in the zoo.

    python benchmarks/zoo_conflict.py          # bad_document 0, clean 2, clean_packed 0, packed_bad_doc 0 (55 s)
    python benchmarks/zoo_conflict.py --runs mild_3of8:1 clean:0

Result (docs/benchmarks.md): none separates. The bad document's cosines sit
inside the clean steps' spread, and the clean steps that fired sit inside both.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo import demo  # noqa: E402
from zoo.demo import (DemoData, DemoSetting, injection_steps, per_term, term_weights, train_step,  # noqa: E402
                      unit_index, unit_means)

# clean steps where the zoo's detector fired on the largest sample loss (seed -> steps; docs/benchmarks.md)
FIRED = {("clean", 2): (190, 193), ("clean_packed", 0): (205,), ("clean_packed", 1): (274,),
         ("clean_packed", 2): (130, 180, 274)}


def _dot(a, b, w=None) -> float:
    return sum(float((x * y * (1.0 if w is None else m)).sum()) for x, y, m in zip(a, b, w or [None] * len(a)))


def cosine(a, b, w=None) -> float:
    """Cosine of two gradients (lists of tensors), in the metric ``w`` (elementwise weights) when given."""
    return _dot(a, b, w) / max(math.sqrt(_dot(a, a, w) * _dot(b, b, w)), 1e-30)


def adam_metric(opt, params, grads) -> list[torch.Tensor]:
    """``1 / (sqrt(v_hat) + eps)`` of the step about to be taken (``v`` updated with ``grads``): a sample's
    share of Adam's update is its gradient in this metric, so a cosine there is the update's, not the
    gradient's (a junk sample's weight lands where ``v`` is small)."""
    at = {id(p): i for i, p in enumerate(params)}
    out: list[torch.Tensor] = [torch.zeros(())] * len(params)
    for group in opt.param_groups:
        (_, b2), eps = group["betas"], group["eps"]
        for p in group["params"]:
            g = grads[at[id(p)]]
            st = opt.state.get(p, {})
            t = int(float(st.get("step", 0))) + 1
            v = b2 * st.get("exp_avg_sq", torch.zeros_like(g)) + (1 - b2) * g * g
            out[at[id(p)]] = 1.0 / ((v / (1 - b2 ** t)).sqrt() + eps)
    return out


@torch.no_grad()
def excess_surprise(model, b) -> torch.Tensor:
    """Each unit's mean of ``loss - entropy`` over its terms: what the text costs beyond what the model
    itself expected to pay there (about 0 where it is calibrated; junk it is sure is English should
    stand out, hard-but-ordinary text such as digits should not)."""
    logp = torch.log_softmax(model(b.x).float(), -1)  # (B, T, V)
    ce = -logp.gather(-1, b.y[..., None])[..., 0]
    per = ce + (logp.exp() * logp).sum(-1)  # loss - entropy, (B, T)
    return unit_means(b, per)


def measure(scenario: str, seed: int, steps: int, s: DemoSetting, corpus: str) -> list[dict]:
    sc = demo.SCENARIOS.get(scenario)
    loss = sc.loss if sc else ("token" if scenario == "clean_packed" else "sample")
    model, opt, sched, _ = demo.build(s, seed)  # the monitor is never called: plain training
    data = DemoData(corpus, s, seed)
    at = injection_steps(sc, s) if sc else []
    params = list(model.parameters())
    out = []
    for step in range(steps):
        hit = step in at
        b = data.injected(scenario, step, loss, at.index(step)) if hit else data.clean(step, loss)
        opt.zero_grad(set_to_none=True)
        _, units = train_step(model, b, loss)
        full = [p.grad.detach().clone() for p in params]
        if step >= 40:
            k = int(units.argmax())
            model.zero_grad(set_to_none=True)
            keep = (unit_index(b)[0] == k).float() * b.mask  # unit k's terms
            per, sel = per_term(model, b, keep)
            (per * (term_weights(b, loss) * keep).flatten()[sel]).sum().backward()
            own = [torch.zeros_like(p) if p.grad is None else p.grad.detach() for p in params]
            rest = [g - c for g, c in zip(full, own)]
            total = sum(float(g.pow(2).sum()) for g in full)
            out.append({"step": step, "hit": hit, "cos": cosine(own, rest), "share": _dot(own, own) / total,
                        "adam_cos": cosine(own, rest, adam_metric(opt, params, full)),
                        "excess": excess_surprise(model, b)[k]})
            for p, g in zip(params, full):
                p.grad = g
        opt.step()
        sched.step()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=["bad_document:0", "clean:2", "clean_packed:0", "packed_bad_doc:0"],
                    help="scenario:seed pairs (zoo/demo.py's scenarios, clean, clean_packed)")
    ap.add_argument("--steps", type=int, default=280)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = DemoSetting()
    corpus, _ = demo.context(s)
    for run in args.runs:
        scenario, seed = run.split(":")
        rows = measure(scenario, int(seed), args.steps, s, corpus)
        print(f"{scenario} seed {seed}:")
        for key in ("cos", "adam_cos", "excess"):
            clean = sorted(r[key] for r in rows if not r["hit"])
            q = statistics.quantiles(clean, n=20)
            print(f"  {key}: clean steps min {clean[0]:+.2f}, 5% {q[0]:+.2f}, median {statistics.median(clean):+.2f}, "
                  f"95% {q[-1]:+.2f}, max {clean[-1]:+.2f}")
            hits = [r for r in rows if r["hit"]]
            if hits:
                print("    injected: " + " ".join(f"{r[key]:+.2f}" for r in hits))
            fired = [r for r in rows if r["step"] in FIRED.get((scenario, int(seed)), ())]
            if fired:
                print("    clean steps that fired in the zoo: " + ", ".join(f"step {r['step']} {r[key]:+.2f}"
                                                                          for r in fired))
        hits = [r for r in rows if r["hit"]]
        if hits:
            print("  injected: share of the step's squared norm " + " ".join(f"{r['share']:.2f}" for r in hits))


if __name__ == "__main__":
    main()
