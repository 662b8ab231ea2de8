"""A loss scaler's routine overflow is not a spike.

``torch.amp.GradScaler`` starts its scale high on purpose (65536) and halves it whenever the scaled
gradients overflow float16, skipping that step itself (a fused optimizer reads its ``found_inf``; a
non-fused one is never stepped). Those steps are how the scaler finds its level: treated as spikes,
each printed a "precision ... a hardware fault" block and spent the localizer's probes (held-out
tester, round 12: 8 events in 40 steps at ``init_scale=2**24``). They are logged as
``train/skipped_step`` instead. Two things still fire as before: a step whose loss itself is not finite
(the forward overflowed, or the data holds a NaN: the scaler's halving cannot help), and
``MAX_IN_A_ROW`` overflows in a row (the scale is collapsing: something upstream is non-finite).
"""
from __future__ import annotations

import math

MAX_IN_A_ROW = 10  # 2**10 = 1024x below the scale it started from; a healthy scaler settles well before


class ScalerOverflows:
    """Counts a loss scaler's overflow steps in a row; ``routine(...)`` says whether this one is."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def routine(self, grads_finite: bool, loss: float | None) -> bool:
        """Is this scaler step's non-finite gradient the scaler's routine overflow (not a spike)? ``loss``:
        the step's loss when known (None: it does not say)."""
        if grads_finite:
            self.in_a_row = 0
            return False
        if loss is not None and not math.isfinite(loss):
            return False
        self.in_a_row += 1
        return self.in_a_row < MAX_IN_A_ROW
