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
(``tracking``); rank 0 prints the spike block (``gradloc_track.console``, as every front door does)
naming the culprit response, or why the spike was not localized.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...console import TrainConsole
from ...localizer.step import LocateStep
from ...spikes.context import per_micro_batch
from ..options import WatchOptions
from .columns import INDEX_KEY, document_columns, group_index, sample_columns, token_columns, uids
from .layout import SEGMENT_NAMES, MicroBatch, unsupported
from .probe_loss import agg_mode, make_loss_fn
from .recorder import StepRecorder

NORMALISERS = {"token-mean": "batch_num_tokens", "seq-mean-token-sum": "global_batch_size"}


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def normaliser(batches: list[MicroBatch], loss_function: Callable) -> int | None:
    """What verl's loss divides by, global over the data-parallel ranks: ``batch_num_tokens``
    (``token-mean``) or ``global_batch_size`` (``seq-mean-token-sum``); None for the others."""
    from verl.utils import tensordict_utils as tu

    key = NORMALISERS.get(agg_mode(loss_function))
    value = None if key is None else tu.get_non_tensor_data(data=batches[0].data, key=key, default=None)
    return value if isinstance(value, (int, float)) and value > 0 else None


def locate_step(engine: Any, batches: list[MicroBatch], loss_function: Callable) -> LocateStep:
    """The step as every localizer takes it: per micro-batch (verl's own split) the probe loss,
    the loss-term mask, the RNG state, the packed documents (``use_remove_padding=True``: each
    response a document of the one packed row), the RL sample columns and verl's normaliser."""
    rank, world = _rank()
    pick, packed = per_micro_batch(len(batches)), batches[0].geo.packed
    # a packed micro-batch is ONE row: its cell holds a value per document (response)
    columns = document_columns if packed else sample_columns
    samples = [columns(mb, rank if world > 1 else None) for mb in batches]
    return LocateStep(loss_fn=pick([make_loss_fn(engine, mb, loss_function) for mb in batches]),
                      token_mask=pick([mb.token_mask() for mb in batches]), rng_state=pick([mb.rng for mb in batches]),
                      document_ids=pick([mb.document_ids() for mb in batches]) if packed else None,
                      sample_columns={k: pick([s[k] for s in samples]) for k in samples[0]},
                      normaliser=normaliser(batches, loss_function))


def spike_context(engine: Any, batches: list[MicroBatch], loss_function: Callable, tokenizer: Any) -> Any:
    """The step (``locate_step``: the one place it is built) with what the artifacts show: the
    token each position scores, the prompt/response segments, the RL token columns. The monitor
    hands the step's fields on to the localizer (``LocateStep.from_context``)."""
    from ...spikes.context import SpikeContext

    step, pick = locate_step(engine, batches, loss_function), per_micro_batch(len(batches))
    tokens = [token_columns(mb) for mb in batches]
    return SpikeContext(
        loss_fn=step.loss_fn, token_mask=step.token_mask, rng_state=step.rng_state, document_ids=step.document_ids,
        sample_columns=step.sample_columns, normaliser=step.normaliser, tokenizer=tokenizer,
        input_ids=pick([mb.display_ids() for mb in batches]), segment_ids=pick([mb.segment_ids() for mb in batches]),
        extra_columns={k: pick([t[k] for t in tokens]) for k in tokens[0]}, segment_names=SEGMENT_NAMES)


def build_handle(engine: Any, opts: WatchOptions) -> Any:
    """The ``WatchHandle`` on the engine's module and optimizer, through the one handle and the one
    join (``handle.open_handle`` with ``tracking.verl_door``): metrics held for verl's output,
    artifacts into verl's run, the run recorded in the run dir."""
    from ..handle import open_handle
    from .tracking import verl_door

    return open_handle(engine.module, engine.optimizer, opts, verl_door(opts, _rank()[0]))


class GradLocSession:
    """One engine's monitor. ``train_batch(data, loss_function)`` replaces ``BaseEngine.train_batch``."""

    def __init__(self, engine: Any, opts: WatchOptions, stream: Any = None) -> None:
        if getattr(engine, "scaler", None) is not None:
            raise ValueError("gradloc-track: verl's fp16 GradScaler is not supported (use bf16 or fp32)")
        self.engine, self.opts = engine, opts
        self.console = TrainConsole(stream=stream or sys.stdout, rich=False)  # rank 0's spike blocks
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
        armed = self.handle.reads_batches
        with self.recorder.recording() if armed else contextlib.nullcontext():
            outputs = engine.forward_backward_batch(data, loss_function, forward_only=False)
        batches = self.recorder.take()
        why = self._why_not(data) if armed else None
        ctx = functools.partial(spike_context, engine, batches, loss_function, self.opts.tokenizer) \
            if armed and not why else None
        stats = self.last = self.handle.step(self.steps, spike_context=ctx)
        grad_norm = self._optimizer_step(stats)
        if engine.is_mp_src_rank_with_outputs():
            metrics = outputs["metrics"]
            assert "grad_norm" not in metrics
            metrics["grad_norm"] = grad_norm
            metrics.update({k: [v] for k, v in self.handle.tracker.take().items() if k not in metrics})
        if _rank()[0] == 0 and stats.events:
            self.handle.flush()  # the spike's artifacts reach verl's run before verl may end it
            self._print_block(stats, why)
        self.steps += 1
        return outputs

    def _print_block(self, stats: Any, why: str | None) -> None:
        """The spike block (``block.spike_lines``: gradloc_track.console's, in the node's words),
        printed and kept in the run dir; never raises into training."""
        from .block import keep_block, spike_lines

        try:
            lines = spike_lines(stats, self.handle.run_dir, why, self.opts)
        except Exception as exc:  # the console is a nicety
            warnings.warn(f"gradloc-track: could not print the spike block of step {stats.step}: {exc!r}")
            return
        cause = getattr(getattr(stats, "outcome", None), "cause", None)
        self.console.block(lines, getattr(cause, "aftermath_of", None))  # (a few of a flood's lines: console.flood)
        keep_block(self.opts.run_dir, lines)  # the file keeps every one

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
        """Every hook off, the run closed (a joined run stays open for verl); once."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self.finish)
        self.handle.close(status)


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
