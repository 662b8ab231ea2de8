"""``GradLocSession``: verl's ``BaseEngine.train_batch`` with the monitor between backward and step.

verl 0.9's ``train_batch`` is ``optimizer_zero_grad`` -> ``forward_backward_batch(data,
loss_function)`` -> ``optimizer_step`` (``clip_grad_norm_`` to ``optim.clip_grad``, the update
skipped when the norm is not finite). The session runs the same three, recording the micro-batches
(``recorder``), and between the last backward and the step runs the monitor: per-layer norms,
clip thresholds, spike detection, and on a spike the localizer, whose probes replay verl's own
``forward_step`` and loss (``probe_loss``). With ``clip`` configured our clipper has clipped in
the monitor and replaces ``clip_grad_norm_``; verl's skip rule is kept exactly (a non-finite
pre-clip norm zeroes the gradients and skips the update). Without it verl's ``optimizer_step``
runs as it is, on the gradient the monitor saw. The step's metrics join verl's output
(``tracking``); rank 0 prints the spike block naming the culprit response.
"""
from __future__ import annotations

import atexit
import functools
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..options import WatchOptions
from ..rl_columns import print_spike
from .columns import INDEX_KEY, group_index, sample_columns, token_columns, uids
from .layout import SEGMENT_NAMES, MicroBatch, unsupported
from .probe_loss import make_loss_fn
from .recorder import StepRecorder


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def spike_context(engine: Any, batches: list[MicroBatch], loss_function: Callable, tokenizer: Any) -> Any:
    """The step as the localizer takes it: one loss function, mask, RNG state, ids and columns per
    micro-batch. The one place the step is built (``localizer.step.LocateStep`` takes it over)."""
    from ...spikes.context import SpikeContext

    rank, world = _rank()
    one = len(batches) == 1

    def pick(xs):
        return xs[0] if one else xs

    tokens = [token_columns(mb) for mb in batches]
    packed = batches[0].geo.packed  # one packed row per micro-batch: each sample is a document of it
    samples = [{} if packed else sample_columns(mb, rank if world > 1 else None) for mb in batches]
    return SpikeContext(
        loss_fn=pick([make_loss_fn(engine, mb, loss_function) for mb in batches]),
        token_mask=pick([mb.token_mask() for mb in batches]), input_ids=pick([mb.display_ids() for mb in batches]),
        tokenizer=tokenizer, extra_columns={k: pick([t[k] for t in tokens]) for k in tokens[0]},
        sample_columns={k: pick([s[k] for s in samples]) for k in samples[0]},
        rng_state=pick([mb.rng for mb in batches]), segment_ids=pick([mb.segment_ids() for mb in batches]),
        segment_names=SEGMENT_NAMES, document_ids=pick([mb.document_ids() for mb in batches]) if packed else None)


def build_handle(engine: Any, opts: WatchOptions) -> Any:
    """The ``WatchHandle`` on the engine's module and optimizer, metrics held for verl's output,
    artifacts into verl's run (``tracking.join_verl_run``)."""
    from ..runs import ScratchDir
    from ..watch import WatchHandle
    from .tracking import VerlMetrics, join_verl_run

    scratch = ScratchDir()
    inner, owns = join_verl_run(opts, _rank()[0], scratch.path)
    return WatchHandle(engine.module, engine.optimizer, opts, tracker=VerlMetrics(inner), owns_tracker=owns,
                       capture=False, step_hook=False, scratch=scratch)


class GradLocSession:
    """One engine's monitor. ``train_batch(data, loss_function)`` replaces ``BaseEngine.train_batch``."""

    def __init__(self, engine: Any, opts: WatchOptions, stream: Any = None) -> None:
        if getattr(engine, "scaler", None) is not None:
            raise ValueError("gradloc-track: verl's fp16 GradScaler is not supported (use bf16 or fp32)")
        self.engine, self.opts, self.stream = engine, opts, stream
        if opts.tokenizer is None:
            opts.tokenizer = getattr(getattr(engine, "model_config", None), "tokenizer", None)
        self.handle = build_handle(engine, opts)
        self.recorder = StepRecorder(engine)
        self.steps = 0
        self.last = None  # the last GradStats
        self._skipped: str | None = None
        self._finished = False
        atexit.register(self.finish)  # verl's workers never say goodbye: flush what the run has not taken

    @property
    def ours_clip(self) -> bool:
        return self.opts.clip.kind != "none"

    def train_batch(self, data: Any, loss_function: Callable) -> Any:
        from verl.utils.tensordict_utils import maybe_fix_3d_position_ids

        maybe_fix_3d_position_ids(data)
        self._tag_groups(data)
        engine = self.engine
        engine.optimizer_zero_grad()
        with self.recorder.recording():
            outputs = engine.forward_backward_batch(data, loss_function, forward_only=False)
        batches = self.recorder.take()
        ctx = None if self._why_not(data) else functools.partial(spike_context, engine, batches, loss_function,
                                                                self.opts.tokenizer)
        stats = self.last = self.handle.step(self.steps, spike_context=ctx)
        grad_norm = self._optimizer_step(stats)
        if engine.is_mp_src_rank_with_outputs():
            metrics = outputs["metrics"]
            assert "grad_norm" not in metrics
            metrics["grad_norm"] = grad_norm
            metrics.update({k: [v] for k, v in self.handle.tracker.take().items() if k not in metrics})
        if _rank()[0] == 0 and stats.events:
            self.handle.flush()  # the spike's artifacts reach verl's run before verl may end it
            print_spike(stats, stats.locate_view[1] if stats.locate_view else None,
                        self.handle.monitor.artifact_writer.run_dir, self.stream or sys.stdout, noun="response")
        self.steps += 1
        return outputs

    def _tag_groups(self, data: Any) -> None:
        """Each row's index in its group (``uid``), as a (B,) tensor verl splits with the batch."""
        ids = uids(data) if INDEX_KEY not in data.keys() else None  # python strings: no device transfer
        if ids is not None:
            data[INDEX_KEY] = group_index(ids)

    def _why_not(self, data: Any) -> str | None:
        why = unsupported(data)
        if why is not None and self._skipped is None:
            self._skipped = why
            warnings.warn(f"gradloc-track: verl spikes are detected but not localized: {why}", UserWarning,
                          stacklevel=3)
        return why

    def _optimizer_step(self, stats: Any) -> float:
        """verl's ``optimizer_step``, or (our clipper already clipped) its step without
        ``clip_grad_norm_``: the same skip of a non-finite pre-clip norm, the same return value."""
        if not self.ours_clip:
            return self.engine.optimizer_step()
        grad_norm = stats.sq_norms.sum().sqrt()  # the pre-clip global norm, on the device
        optimizer = self.engine.optimizer
        if not torch.isfinite(grad_norm):  # host sync: verl's own rule reads it every step (verl's step does too)
            print(f"WARN: grad_norm is not finite: {grad_norm}")
            optimizer.zero_grad()
        else:
            optimizer.step()
        return grad_norm.item()  # host sync: verl returns the pre-clip norm as a float

    def finish(self, status: str = "success") -> None:
        """Unhook and flush (a joined run stays open for verl); once."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self.finish)
        self.handle.remove()
        self.handle.finish(status)


def attach(engine: Any, cfg: Any = None, **options: Any) -> GradLocSession:
    """Monitor ``engine`` (a verl ``FSDPEngine``): ``engine.train_batch`` goes through the session
    from now on. ``cfg``: a ``gradloc`` node (mapping/DictConfig) or ``options`` as ``watch()``'s."""
    from .options import gradloc_options
    from ..options import resolve_options

    opts = gradloc_options(cfg) if cfg is not None else resolve_options(**options)
    if opts is None:
        raise ValueError("gradloc-track: the gradloc node says enabled=false")
    session = GradLocSession(engine, opts)
    engine.__dict__["_gradloc_session"] = session
    engine.train_batch = session.train_batch  # instance attribute: the class stays verl's
    return session
