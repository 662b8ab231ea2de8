"""The clean steps the zoo's detector fired on: which text, and what one such step does (issue 26).

For each step given (demo family, ``zoo/demo.py``'s model, data, optimizer and schedule; no monitor):
the unit with the largest mean loss (a sample, or a packed document), its text, and its single-step
harm measured as the zoo measures an injection's: held-out loss after the step, against the same
step with that unit replaced by the same position of 12 other clean batches (their mean and spread
give ``z``), from the same state; and the same with random high bytes in its place (``junk``: what
a bad document would have done there).

    python benchmarks/zoo_clean_events.py      # the twins' events: seed 2 (190, 193), packed seed 0 (205)
    python benchmarks/zoo_clean_events.py --run clean:1 --steps 120 150

Result (docs/benchmarks.md): table rules and a Unicode name list; one step's harm has no sign of its
own (the rule window lowers held-out loss at one step and raises it three steps later, as random
bytes would).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo import demo  # noqa: E402
from zoo.demo import Batch, DemoData, DemoSetting, train_step, unit_index  # noqa: E402
from zoo.measure import grads_of, step_effect  # noqa: E402

DEFAULT = [("clean", 2, (150, 190, 193)), ("clean_packed", 0, (180, 205))]  # 150, 180: ordinary steps beside them
REPLACEMENTS = 12


def replaced(b: Batch, k: int, src: Batch) -> Batch:
    """``b`` with unit ``k`` (``unit_index``: a sample, or a packed document) taken from ``src``."""
    at = unit_index(b)[0] == k  # (B, T)
    return Batch(torch.where(at, src.x, b.x), torch.where(at, src.y, b.y), b.mask.clone(), b.docs)


def examine(scenario: str, seed: int, steps: tuple[int, ...], s: DemoSetting, corpus: str, held) -> None:
    loss = "token" if scenario == "clean_packed" else "sample"
    model, opt, sched, _ = demo.build(s, seed)  # the monitor is never called: plain training
    data = DemoData(corpus, s, seed)

    def effect(batch: Batch) -> float:
        model.zero_grad(set_to_none=True)
        train_step(model, batch, loss)
        return step_effect(model, opt, grads_of(model), held.loss)

    for step in range(max(steps) + 1):
        b = data.clean(step, loss)
        if step in steps:
            model.zero_grad(set_to_none=True)
            _, units = train_step(model, b, loss)
            k = int(units.argmax())
            base = effect(b)
            alts = [effect(replaced(b, k, data.clean(step + 10 ** 6 + j, loss))) for j in range(REPLACEMENTS)]
            row = data.garbage(step, b.x.shape[1] + 1)
            junk = effect(replaced(b, k, Batch(row[:-1].expand_as(b.x), row[1:].expand_as(b.y), b.mask)))
            m, sd = statistics.fmean(alts), statistics.stdev(alts)
            text = replaced(Batch(b.x * 0, b.y * 0, b.mask, b.docs), k, b).y.flatten()
            text = bytes(v for v in text.tolist() if v).decode("utf-8", "replace")
            print(f"{scenario} seed {seed} step {step}: unit {k}, loss {float(units[k]):.2f}, {text!r}\n"
                  f"  harm {base - m:+.4f} (z {(base - m) / sd:+.1f}; sd of {REPLACEMENTS} clean replacements "
                  f"{sd:.4f}); random bytes there {junk - m:+.4f} (z {(junk - m) / sd:+.1f})", flush=True)
        opt.zero_grad(set_to_none=True)
        train_step(model, b, loss)
        opt.step()
        sched.step()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=None, help="scenario:seed (clean or clean_packed); default: the twins' events")
    ap.add_argument("--steps", type=int, nargs="+", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = DemoSetting()
    corpus, held = demo.context(s)
    runs = DEFAULT
    if args.run:
        scenario, seed = args.run.split(":")
        runs = [(scenario, int(seed), tuple(args.steps or (190,)))]
    for scenario, seed, steps in runs:
        examine(scenario, seed, steps, s, corpus, held)


if __name__ == "__main__":
    main()
