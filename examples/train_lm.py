"""Train a small GPT on CPU with gradloc-track watching the gradients.

    python examples/train_lm.py                              # MLflow store ./mlflow.db
    python examples/train_lm.py experiment=spike_demo        # inject a spike, localize it
    python examples/train_lm.py experiment=spike_demo tracker=wandb  # the demo in a W&B run
    python examples/train_lm.py -m experiment=spike_demo clip=none,adagc,zclip   # one table of the jobs at the end
    torchrun --nproc_per_node 2 examples/train_lm.py train.inject.step=100 train.inject.rank=1

Every override is a field of gradloc_track.demo.config.DemoConfig (see conf/). Read it top to
bottom: the loss, the set-up, the training loop (batch, backward, the monitor, the optimizer
step), the summary, then the Hydra entry point. The reusable parts (model, data, tokenizer,
injected outliers, console) are in gradloc_track.demo.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from gradloc_track import GradMonitor
from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.clip import build_clipper
from gradloc_track.config import ConfigError, check_overrides, to_config
from gradloc_track.trackers.factory import without_spike_detection
from gradloc_track.demo.config import DemoConfig, register_configs
from gradloc_track.console import TrainConsole, summary_lines
from gradloc_track.demo.data import TextBatches, load_corpus
from gradloc_track.demo.gate import SampleGate, sample_columns
from gradloc_track.demo.inject import inject
from gradloc_track.demo.out_dir import check_out_dir
from gradloc_track.demo.model import build_model
from gradloc_track.demo.optim import make_optimizer, make_schedule
from gradloc_track.demo.threads import set_threads
from gradloc_track.demo.tokenizer import make_tokenizer
from gradloc_track.localizer import save_rng
from gradloc_track.spikes import SpikeContext, SpikeDetector, junk_span, sample_losses, spike_score
from gradloc_track.text import visible_text
from gradloc_track.trackers import NullTracker, Tracker, make_tracker
from gradloc_track.trackers.incomplete import write_run_file
from gradloc_track.trackers.quiet import quiet_backend_noise

register_configs()


# -- the loss -------------------------------------------------------------------------------------

def masked_lm_loss(model, x, y, mask, loss_norm: str):
    """A ``loss_fn(keep)`` for the batch with a FIXED normalizer (computed from the full mask).

    token: sum of kept terms / number of loss tokens in the batch.
    sample: mean over samples of (sum of kept terms / that sample's loss-token count).
    The localizer calls it with parts of the mask to find which terms made a spike.
    ``loss_fn.sample_losses``: each sample's mean loss over its loss tokens, from the last call (the
    training forward's, read before any probe): the spike detector's per-sample signal;
    ``loss_fn.junk``: the junk signal's statistics (a run of terms the model rates below chance).
    """
    B, T = x.shape
    if loss_norm == "token":
        weights = mask / mask.sum().clamp(min=1.0)  # (B, T)
    else:
        weights = mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0) / B  # (B, T)

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        logits = model(x)  # (B, T, V)
        per_tok = F.cross_entropy(logits.reshape(B * T, -1), y.reshape(-1), reduction="none").view(B, T)
        loss_fn.sample_losses = sample_losses(per_tok, mask, x, y)  # (B,); repeats of the input token capped
        loss_fn.junk = junk_span(logits.detach(), y.masked_fill(mask == 0, -100), x)
        return (per_tok * weights * keep).sum()

    return loss_fn


# -- set-up ---------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What the loop uses, built once per run."""

    device: torch.device
    rank: int
    world: int
    started: bool  # we started the process group, so we tear it down
    tokenizer: Any
    junk_ids: list[int] | None  # the injected text's tokens (garbled_span)
    data: TextBatches
    model: torch.nn.Module
    net: torch.nn.Module  # what the loss runs: DDP under torchrun (each rank its own batches)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    adamc: Any  # AdamCWeightDecay with optim=adamc, else None
    console: TrainConsole
    gate: SampleGate  # leaves out the samples of data.blocklist and, with spikes.quarantine, this run's culprits


def init_distributed(device: torch.device) -> tuple[int, int, bool]:
    """(rank, world size, whether we started the group) under torchrun (``WORLD_SIZE`` > 1)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, False
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), started


def close_distributed(started: bool, success: bool) -> None:
    if not started:
        return
    import torch.distributed as dist

    if success:
        dist.barrier()  # nobody tears gloo down while a peer still talks to it
    dist.destroy_process_group()


def setup(cfg: DemoConfig, console: TrainConsole) -> Setup:
    """Seed, tokenizer, process group, model, optimizer, schedule and data, in that order."""
    tc = cfg.train
    set_threads(tc.num_threads)  # null: half the cores, at most 4 (gradloc_track/demo/threads.py)
    torch.manual_seed(tc.seed)
    device = torch.device(tc.device)
    corpus = load_corpus(tc.corpus)
    tokenizer = make_tokenizer(tc.tokenizer, cfg.model.vocab_size, corpus, tc.cache_dir)
    rank, world, started = init_distributed(device)
    if rank != 0:  # one console: rank 0 speaks for the run (it also gathers every culprit's text)
        console = TrainConsole(stream=open(os.devnull, "w"), rich=False)
    model = build_model(cfg.model).to(device)
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    opt = make_optimizer(model, cfg.optim)
    sched = make_schedule(opt, cfg.optim, tc.steps)
    adamc = None
    if cfg.optim.adamc:
        from gradloc_track.adamc import AdamCWeightDecay

        adamc = AdamCWeightDecay.from_config(opt, cfg.optim, scheduler=sched, model=model)
    data = TextBatches(corpus, tc.seq_len, tc.batch_size, tc.seed + 7919 * rank, tokenizer)
    junk_ids = tokenizer.encode(tc.inject.text) if tc.inject.kind == "garbled_span" else None
    return Setup(device, rank, world, started, tokenizer, junk_ids, data, model, net, opt, sched, adamc, console,
                 make_gate(cfg, console))


def make_gate(cfg: DemoConfig, console: TrainConsole) -> SampleGate:
    """``data.blocklist`` (samples blamed in earlier runs) and ``spikes.quarantine`` (blamed in this one)."""
    from gradloc_track.data import Quarantine, load_blocklist

    blocklist = load_blocklist(cfg.data.blocklist, "data.blocklist") if cfg.data.blocklist else None
    if blocklist is not None:
        console.print(f"data.blocklist: {len(blocklist)} sample(s) listed in {cfg.data.blocklist} will be left out")
    return SampleGate(blocklist, Quarantine() if cfg.spikes.quarantine else None)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> flat ``a.b.c`` keys (the form trackers show params in)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def log_config(tracker: Tracker, cfg: DemoConfig, model: torch.nn.Module, run_dir: Path,
               resolved_yaml: str | None) -> None:
    """The resolved config as params (None is noise in a params table) and as ``config.yaml``."""
    params = {k: v for k, v in flatten(asdict(cfg)).items() if v is not None}
    params["model.n_params"] = sum(p.numel() for p in model.parameters())
    tracker.log_params(params)
    if resolved_yaml is not None:
        cfg_path = write_run_file(run_dir, "config.yaml", resolved_yaml)  # a full disk: said, never raised
        if cfg_path is not None:
            tracker.log_artifact(cfg_path)


def build_monitor(cfg: DemoConfig, s: Setup, tracker: Tracker, run_dir: Path) -> GradMonitor:
    """The clipper, the spike detector and the artifact writer, behind one monitor."""
    clipper = build_clipper(cfg.clip, s.model)
    detector = SpikeDetector(cfg.spikes) if cfg.spikes.enabled else None
    writer = SpikeArtifactWriter(tracker, run_dir=run_dir)
    return GradMonitor(s.model, tracker=tracker, clipper=clipper, config=cfg.monitor, optimizer=s.opt,
                       detector=detector, locate_config=cfg.locate, artifact_writer=writer)


# -- the training loop ----------------------------------------------------------------------------

@dataclass
class History:
    """What the summary is made of (logging steps only)."""

    logged: list[int] = field(default_factory=list)  # the logging steps the lists below hold
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    post_norms: list[float] = field(default_factory=list)  # what the optimizer saw (after clipping)
    spikes: list[Any] = field(default_factory=list)  # the GradStats of each step whose spike fired
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step (the spike pause)

    @property
    def events_at(self) -> list[int]:
        return [st.step for st in self.spikes]


def get_batch(cfg: DemoConfig, s: Setup, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Inputs, targets, loss mask and per-sample columns of ``step``: the configured outlier injected on
    its step and rank, then samples of the blocklist / quarantine left out (replaced by fresh windows)."""
    batch = s.data.batch(step).to(s.device)  # (B, T+1)
    x, y = batch[:, :-1].clone(), batch[:, 1:].clone()  # (B, T)
    mask = torch.ones_like(x, dtype=torch.float32)  # (B, T) 1 = a loss term
    source = ["corpus"] * x.shape[0]
    inj = cfg.train.inject
    if inj.at(step) and s.rank == inj.rank % s.world:
        positions = inject(inj.kind, x, y, mask, inj.sample, inj.span, seed=1234 + step, junk_ids=s.junk_ids)
        source[inj.sample] = f"injected:{inj.kind}"
        s.console.print(f"step {step}: injected {inj.kind} into sample {inj.sample} "
                        f"(loss positions {positions[0]}-{positions[-1]}: "
                        f"'{visible_text(s.tokenizer.decode(y[inj.sample, positions].tolist()))}')")
    for row, fp, why in s.gate.apply(step, x, y, mask, source, lambda b, k: s.data.replacement(step, b, k)):
        s.console.print(f"step {step}: left out sample {row} ({why}: sample_id {fp}); a fresh window trains instead")
    return x, y, mask, sample_columns(step, s.rank, s.world, x.shape[0], source)


def train(cfg: DemoConfig, s: Setup, monitor: GradMonitor, tracker: Tracker, run_dir: Path) -> History:
    h = History()
    t0 = time.perf_counter()
    s.console.start(cfg.train.steps)
    for step in range(cfg.train.steps):
        t_step = time.perf_counter()
        x, y, mask, columns = get_batch(cfg, s, step)
        loss_fn = masked_lm_loss(s.net, x, y, mask, cfg.train.loss_norm)
        s.opt.zero_grad(set_to_none=True)
        rng = save_rng()  # right before the forward: the localizer's probes replay its dropout
        loss = loss_fn(mask)
        loss.backward()
        # norms, clipping, spike detection and (on a spike) localization: before the optimizer step
        ctx = SpikeContext(loss_fn=loss_fn, token_mask=mask, input_ids=y, tokenizer=s.tokenizer, rng_state=rng,
                           sample_columns=columns)
        # the loss and each sample's loss feed the detector too: data damage shows in them first
        stats = monitor.after_backward(step, spike_context=ctx, loss=loss.detach(), sample_losses=loss_fn.sample_losses,
                                       junk_span=loss_fn.junk)
        if s.gate.quarantine is not None and stats.blamed_rows:  # this step's culprits: skipped when they come again
            s.gate.quarantine.blame(step, *stats.blamed_rows)  # every rank's, on every rank
        s.opt.step()
        s.sched.step()
        if s.adamc is not None:
            s.adamc.step()
        log_step(cfg, s, tracker, h, step, loss, stats)
        log_left_out(s, tracker, step)
        if stats.events:
            show_spike(s, h, step, stats, run_dir)
        h.step_seconds.append(time.perf_counter() - t_step)
    h.seconds = time.perf_counter() - t0
    return h


def log_step(cfg: DemoConfig, s: Setup, tracker: Tracker, h: History, step: int, loss: torch.Tensor,
             stats: Any) -> None:
    """The loss next to the monitor's metrics, and the progress line."""
    loss_val = None
    if stats.logged:  # host sync: the loss is printed/logged on logging steps only
        loss_val = loss.item()
        h.logged.append(step)
        h.losses.append(loss_val)
        h.norms.append(stats.global_norm)
        h.post_norms.append(stats.metrics.get("clip/total_norm_post", stats.global_norm))
        extra = {"train/loss": loss_val}
        if cfg.clip.kind == "none":  # so a clip=none run overlays the clipped runs' curves
            extra["clip/total_norm_pre"] = extra["clip/total_norm_post"] = stats.global_norm
        tracker.log_metrics(extra, step)
    s.console.step(step, loss_val, stats.global_norm if stats.logged else None)


def log_left_out(s: Setup, tracker: Tracker, step: int) -> None:
    """``data/blocklist_dropped`` / ``data/quarantine_skipped`` (running counts) at the steps they grow."""
    metrics = s.gate.metrics()
    if metrics and (step == 0 or any(st == step for st, *_ in s.gate.left_out)):
        tracker.log_metrics(metrics, step)


def show_spike(s: Setup, h: History, step: int, stats: Any, run_dir: Path) -> None:
    """One console block per spike: the signal, the culprit text, level and share, where to look."""
    h.spikes.append(stats)
    # under DDP rank 0 shows every culprit's sample (gathered); the other ranks' consoles are silent
    s.console.spike(stats, run_dir)


# -- the summary ----------------------------------------------------------------------------------

def guard_stats(cfg: DemoConfig, h: History, settled: int) -> dict[str, float]:
    """What a clipper did after the start-up transient, clean and injected steps apart (logging steps):
    ``clean_clipped_fraction`` / ``clean_mean_coef`` (a clipper that scales most clean steps hard is a
    learning-rate cut), ``spike_clipped_fraction`` (the injected steps it scaled) and ``spike_held``: the
    largest post-clip norm of an injected step over the median post-clip norm of the clean ones (1x: the
    optimizer saw the spike no larger than a normal step)."""
    clean, hit = [], []
    for step, pre, post in zip(h.logged, h.norms, h.post_norms):
        if step >= settled:
            (hit if cfg.train.inject.at(step) else clean).append((pre, post))
    out: dict[str, float] = {}
    if clean:
        coefs = [post / pre if pre > 0 else 1.0 for pre, post in clean]
        out["clean_clipped_fraction"] = sum(c < 1.0 - 1e-6 for c in coefs) / len(coefs)
        out["clean_mean_coef"] = sum(coefs) / len(coefs)
    if hit:
        out["spike_clipped_fraction"] = sum(post < pre * (1.0 - 1e-6) for pre, post in hit) / len(hit)
    if clean and hit:
        typical = sorted(post for _, post in clean)[len(clean) // 2]
        out["spike_held"] = max(post for _, post in hit) / max(typical, 1e-12)
    return out


PAUSE_WINDOW = 10  # steps either side of a spike: their median is a normal step, those after it what it still slows


def spike_pause(step_seconds: list[float], step: int, window: int = PAUSE_WINDOW) -> tuple[float, float] | None:
    """(the spike's pause in normal steps, the part of it after the spike step): the spike step's wall time
    plus what the ``window`` steps after it took beyond normal, over a normal step (the median of the
    ``window`` steps either side: a machine whose load drifts moves both halves). A step without a spike
    is 1; localizing with P probes costs about P more. None without steps around it to tell the pace."""
    around = step_seconds[max(0, step - window):step] + step_seconds[step + 1:step + 1 + window]
    if len(around) < 2 * window:
        return None
    normal = sorted(around)[len(around) // 2]
    after = sum(t - normal for t in step_seconds[step + 1:step + 1 + window])
    return (step_seconds[step] + after) / normal, after / normal


def show_pauses(s: Setup, h: History) -> None:
    """One line per localized spike: how long it held training up, in normal steps, against its probes."""
    for st in h.spikes:
        pause = spike_pause(h.step_seconds, st.step)
        probes = st.metrics.get("locate/probes")
        if pause is not None and probes is not None:
            cut = getattr(st.surgery, "probes", 0) if st.surgery is not None else 0  # spikes.response=surgery's
            after = round(pause[1], 1) + 0.0  # +0.0, never -0.0
            s.console.print(f"spike pause at step {st.step}: training held up {pause[0]:.1f} normal steps for "
                            f"{probes:.0f}{f' + {cut}' if cut else ''} probes (the {PAUSE_WINDOW} steps after it: "
                            f"{after:+.1f} against their usual pace)")


def summarize(cfg: DemoConfig, h: History, clipper: Any = None) -> dict[str, float]:
    """Final loss, spike count, OLMo-style spike scores, the largest norm the optimizer saw, and
    how often / how hard the clipper scaled after its warm-up (a learning-rate cut shows there)."""
    settled = max(cfg.spikes.warmup_steps, cfg.optim.warmup_steps)  # skip the start-up transient
    clip = guard_stats(cfg, h, settled)
    if clipper is not None and getattr(clipper, "saturation", None) is not None:
        sat = clipper.saturation.summary()  # host sync: once, at the end
        clip.update({"clip_steps_after_warmup": float(sat["steps"]), "clip_clipped_fraction": sat["clipped_fraction"],
                     "clip_mean_coef": sat["mean_coef"]})
    return {**clip,
        "final_loss": float(sum(h.losses[-10:]) / max(1, len(h.losses[-10:]))),
        "spike_events": float(len(h.events_at)),
        "loss_spike_score": float(spike_score(h.losses)),
        "grad_spike_score": float(spike_score(h.norms)),
        "post_clip_grad_spike_score": float(spike_score(h.post_norms)),
        # NaN: the run ended inside the start-up transient, no step to take the largest of
        "max_post_clip_grad_norm": float(max(h.post_norms[settled // cfg.monitor.log_every:], default=float("nan"))),
        "seconds": h.seconds,
    }


def train_lm(cfg: DemoConfig, run_dir: str | Path, resolved_yaml: str | None = None,
             console: TrainConsole | None = None) -> dict[str, float]:
    """Train, monitor and log one run. Returns a summary (final loss, spikes, spike score...).

    ``console`` shows progress, spikes and the closing summary (default: a ``TrainConsole`` on
    stderr: a progress bar on a terminal, a plain line every tenth of the run otherwise).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    s = setup(cfg, console or TrainConsole())
    inj = cfg.train.inject
    if inj.step is not None and inj.step >= cfg.train.steps and s.rank == 0:  # a shortened demo injects nothing
        s.console.print(f"note: train.inject.step={inj.step} is past the run's last step (train.steps="
                        f"{cfg.train.steps}): nothing is injected; set train.inject.step below {cfg.train.steps}")
    # one run per training run: rank 0 logs; the monitor gathers culprits from every rank to it
    tracks = cfg.tracker if cfg.spikes.enabled else without_spike_detection(cfg.tracker)  # (spike_count: "off")
    tracker = make_tracker(tracks, run_dir=run_dir, run_name=cfg.run_name) if s.rank == 0 else NullTracker()
    status = "failed"
    try:
        log_config(tracker, cfg, s.model, run_dir, resolved_yaml)
        monitor = build_monitor(cfg, s, tracker, run_dir)
        h = train(cfg, s, monitor, tracker, run_dir)
        show_pauses(s, h)
        summary = summarize(cfg, h, monitor.clipper)
        summary.update({k.split("/", 1)[1]: v for k, v in s.gate.metrics().items()})  # samples left out
        # at the last training step: a metric at step N+1 would stretch every chart's x axis
        tracker.log_metrics({f"summary/{k}": v for k, v in summary.items()}, cfg.train.steps - 1)
        if s.rank == 0:
            left_out = [{"step": st, "sample": b, "sample_id": fp, "why": why} for st, b, fp, why in s.gate.left_out]
            write_run_file(run_dir, "summary.json", json.dumps({**summary, "events_at": h.events_at,
                                                                "left_out": left_out}, indent=2))
        status = "success"
    finally:
        s.console.close()
        tracker.finish(status)
        close_distributed(s.started, status == "success")
    s.console.summary(summary_lines(cfg.train.steps, cfg.clip.kind, summary, h.spikes, run_dir,
                                    detecting=monitor.detector is not None))
    return summary


# -- the Hydra entry point ------------------------------------------------------------------------

HYDRA_ONLY = {".hydra", "train_lm.log"}  # what Hydra itself puts in a run dir before main() runs


def swept_run_name(base: str | None, job_overrides: list[str], argv: list[str]) -> str:
    """``spike_demo[clip=adagc]``: the run name plus only the overrides this multirun sweeps."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept = {o.key_or_group for o in OverridesParser.create().parse_overrides(
        [a for a in argv if "=" in a and not a.startswith("-")]) if o.is_sweep_override()}
    parts = [o for o in job_overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    label = ",".join(parts)
    return f"{base}[{label}]" if base and label else (base or label or "run")


def job_run_name(cfg: DemoConfig, job_overrides: list[str], argv: list[str], multirun: bool) -> str:
    """The tracker run's name: ``spike_demo clip=adagc seed=0 11-25 17:36:05`` (the experiment, the
    clipper, the seed, the start), so every run tells apart in the experiment's chart view; under
    ``-m`` the swept overrides instead of the clipper (``spike_demo[clip=adagc] seed=0 ...``). A
    ``run_name=`` the user passed is kept as given (plus the swept overrides)."""
    name = swept_run_name(cfg.run_name, job_overrides, argv) if multirun else cfg.run_name
    if any(o.split("=", 1)[0].lstrip("+~") == "run_name" for o in job_overrides):
        return name
    parts = [name or "train_lm"]
    parts += [] if "clip=" in parts[0] else [f"clip={cfg.clip.kind}"]
    parts += [] if "seed=" in parts[0] else [f"seed={cfg.train.seed}"]
    return " ".join(parts + [time.strftime("%m-%d %H:%M:%S")])


def remove_if_empty(run_dir: Path, out_dir: Path) -> None:
    """A failed attempt leaves no run dir holding nothing but Hydra's own files (nor empty parents)."""
    if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= HYDRA_ONLY:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != out_dir and out_dir in parent.parents and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    out_dir = Path(cfg.out_dir).resolve()
    try:
        conf = to_config(cfg)
    except ConfigError as exc:
        remove_if_empty(run_dir.resolve(), out_dir)
        sys.exit(f"error: {exc}")  # printed once, by sys.exit
    conf.run_name = job_run_name(conf, list(hc.overrides.task), sys.argv[1:], str(hc.mode) == "RunMode.MULTIRUN")
    try:
        summary = train_lm(conf, run_dir, resolved_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    except ImportError as exc:
        remove_if_empty(run_dir.resolve(), out_dir)
        if "pip install 'gradloc-track[" in str(exc):  # an extra not installed (tracker=wandb without wandb)
            sys.exit(f"error: {exc}")  # one line, as a config error (it was a 40-line traceback)
        raise
    except Exception:
        remove_if_empty(run_dir.resolve(), out_dir)
        raise
    return summary["final_loss"]


if __name__ == "__main__":
    try:
        # a renamed key (clip.layer_alpha) names the new one, a typo (monitor.log_evry) the closest field
        check_overrides(sys.argv[1:], DemoConfig, Path(__file__).resolve().parents[1] / "conf")
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    bad_dir = check_out_dir(sys.argv[1:])
    if bad_dir:
        sys.exit(f"error: {bad_dir}")
    quiet_backend_noise()  # our command: no "Creating initial MLflow database tables" lines
    main()
