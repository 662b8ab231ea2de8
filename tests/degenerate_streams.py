"""Random streams of degenerate steps (issue 17), shared by the clipper and detector properties.

Missing, zero, NaN and Inf gradients (single tensors or whole steps) at random steps, step 0 and the
warm-up included, then a clean stretch, then one real spike. After the clean stretch every clipper
must clip like a healthy one (tests/clip/test_clipper.py) and the detector must stay quiet and catch
the spike (tests/spikes/test_detector.py)."""
from __future__ import annotations

import math
import random

import torch

WARMUP = 5
DIRTY, CLEAN = 40, 40  # steps with degenerate events, then clean steps, then one spike
KINDS = ("missing", "zero", "nan", "inf")


def model3():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


def degenerate_stream(model, seed):
    """Per step a list of gradients (None = missing). Degenerate events hit ~25% of the first
    DIRTY steps (always step 0): one tensor or the whole step goes missing, zero, NaN or Inf."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    shapes = [p.shape for p in model.parameters()]
    out = []
    for t in range(DIRTY + CLEAN + 1):
        grads = [torch.randn(s, generator=gen) * 0.05 * math.exp(rnd.gauss(0, 0.1)) for s in shapes]
        if t == DIRTY + CLEAN:  # the real spike
            grads = [g * 50.0 for g in grads]
        elif t < DIRTY and (t == 0 or rnd.random() < 0.25):
            kind = rnd.choice(KINDS)
            hit = range(len(grads)) if rnd.random() < 0.4 else [rnd.randrange(len(grads))]
            for i in hit:
                if kind == "missing":
                    grads[i] = None
                elif kind == "zero":
                    grads[i] = torch.zeros(shapes[i])
                else:
                    grads[i][tuple(0 for _ in shapes[i])] = math.nan if kind == "nan" else math.inf
        out.append(grads)
    return out
