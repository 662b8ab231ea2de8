"""``spikes.response=surgery`` through GradMonitor: what the optimizer receives is the step's
gradient minus the culprits' (a separate backward of their terms, plain per-parameter loop),
then clipped by the clipper; no culprit: nothing removed, and it says so."""
from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import GlobalClip
from gradloc_track.config import ConfigError, LocateConfig, RootConfig, SpikeConfig
from gradloc_track.console import TrainConsole
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer import save_rng
from gradloc_track.localizer.probe import restore_rng
from gradloc_track.spikes import SpikeContext, SpikeDetector

V, B, T = 64, 4, 16
SPIKE_AT, STEPS = 9, 11
MAX_NORM = 0.3
WEIGHT = 30.0  # the culprit term's loss weight


def grads_of(model, loss) -> list[torch.Tensor]:
    params = list(model.parameters())
    return [torch.zeros_like(p) if g is None else g for p, g in
            zip(params, torch.autograd.grad(loss, params, allow_unused=True))]


def norm(g) -> float:
    return math.sqrt(sum(float(x.double().pow(2).sum()) for x in g))


def clip_ref(g: list[torch.Tensor]) -> list[torch.Tensor]:
    """``clip_grad_norm_`` by hand: ``g * min(1, max_norm / (||g|| + 1e-6))``."""
    coef = min(1.0, MAX_NORM / (norm(g) + 1e-6))
    return [x * coef for x in g]


def micro_batches(step: int, k: int):
    """K micro-batches of step ``step``: (x, y, w) each (B, T); a heavy term at the spike step."""
    g = torch.Generator().manual_seed(step)
    out = [(torch.randint(0, V, (B, T), generator=g), torch.randint(33, V, (B, T), generator=g), torch.ones(B, T))
           for _ in range(k)]
    if step == SPIKE_AT:
        out[k - 1][2][2, 7] = WEIGHT  # one loss term of the last micro-batch blows up
    return out


def loss_fns(model, mbs):
    """The training loss of each micro-batch, restricted to ``mask``: the loop's 1/K included."""
    def make(x, y, w):
        def loss_fn(mask):
            per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
            return (per * w * mask).sum() / (B * T * len(mbs))
        return loss_fn
    return [make(*mb) for mb in mbs]


def run(model, k: int, locate: LocateConfig | None = None, console: TrainConsole | None = None,
        run_dir: Path | None = None, clip: bool = True):
    """A loop of STEPS steps, K micro-batches each, GlobalClip after surgery. Returns what the
    optimizer received at the spike step, the step's own gradient, the culprits' reference
    gradient and the stats."""
    tracker = MemoryTracker()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clipper = GlobalClip(model, max_norm=MAX_NORM) if clip else None
    monitor = GradMonitor(model, tracker=tracker, clipper=clipper, log_every=4,
                          optimizer=opt, detector=SpikeDetector(SpikeConfig(warmup_steps=4, response="surgery")),
                          locate_config=locate or LocateConfig())
    received: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, kw: received.append([p.grad.clone() for p in model.parameters()]))
    for step in range(STEPS):
        mbs = micro_batches(step, k)
        fns = loss_fns(model, mbs)
        opt.zero_grad(set_to_none=True)
        rngs = []
        for fn in fns:
            rngs.append(save_rng())
            fn(torch.ones(B, T)).backward()
        if step == SPIKE_AT:
            twin, spike_rngs = copy.deepcopy(model), rngs  # this step's weights and RNG, for the reference
            own = [p.grad.clone() for p in model.parameters()]
        ctx = SpikeContext(fns, [torch.ones(B, T)] * k, [y for _, y, _ in mbs], ByteTokenizer(), rng_state=rngs)
        stats = monitor.after_backward(step, spike_context=ctx if k > 1 else ctx.micro_batch_view(0))
        if step == SPIKE_AT:
            spike = stats
            if console is not None:
                console.spike(stats, run_dir)  # the block reads the step's own view (its batch and surgery)
        opt.step()
    cut = culprits_gradient(twin, micro_batches(SPIKE_AT, k), spike.locate, spike_rngs)
    return received, own, cut, spike, tracker


def culprits_gradient(twin, mbs, result, rngs) -> list[torch.Tensor]:
    """A separate backward of the culprits' terms (the rows the result names), micro-batch by micro-batch."""
    total = [torch.zeros_like(p) for p in twin.parameters()]
    fns = loss_fns(twin, mbs)
    for k, fn in enumerate(fns):
        mask = torch.zeros(B, T)
        for c in result.culprits:
            if (c.micro_batch or 0) == k:
                mask[c.batch, c.start:c.end] = 1.0
        if mask.any():
            restore_rng(rngs[k])
            for acc, g in zip(total, grads_of(twin, fn(mask))):
                acc += g
    return total


@pytest.mark.parametrize("k", [1, 3])
def test_the_optimizer_gets_the_step_minus_the_culprits_then_clipped(k):
    torch.manual_seed(0)
    from gradloc_track.demo.model import TinyGPT

    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T)
    received, own, cut, spike, tracker = run(model, k)
    assert spike.events and [(c.micro_batch or 0, c.batch, c.position) for c in spike.locate.culprits] == \
        [(k - 1, 2, 7)]
    operated = [g - c for g, c in zip(own, cut)]
    want = clip_ref(operated)
    got = received[SPIKE_AT]
    assert norm([a - b for a, b in zip(got, want)]) / norm(want) < 1e-6
    assert norm(operated) > MAX_NORM  # the clipper really scaled the operated gradient
    logged = dict(tracker.metrics)[SPIKE_AT]
    assert logged["surgery/applied"] == 1.0
    assert spike.surgery.probes == 0  # the search's own probe of the culprit token served (localizer/cut.py)
    share = sum(float((c.double() * g.double()).sum()) for c, g in zip(cut, own)) / norm(own) ** 2
    assert logged["surgery/removed_share"] == pytest.approx(share, rel=1e-5) and 0.5 < share < 0.99
    assert logged["surgery/grad_norm_post"] == pytest.approx(norm(operated), rel=1e-5)
    assert logged["clip/total_norm_pre"] == pytest.approx(norm(operated), rel=1e-5)  # the clipper saw the operated
    assert logged["grad_norm/global"] == pytest.approx(norm(own), rel=1e-5)  # the step's own norm stays logged
    assert not any("surgery/" in key for s, m in tracker.metrics if s != SPIKE_AT for key in m)


def test_no_culprit_nothing_removed_and_it_says_so(tmp_path):
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T)
    out = io.StringIO()
    received, own, _, spike, tracker = run(model, 1, LocateConfig(method="ghost", threshold=1e9),
                                           TrainConsole(stream=out, rich=False), tmp_path)
    assert spike.events and spike.locate is not None and not spike.locate.culprits
    assert not spike.surgery.applied and "no culprit found" in spike.surgery.reason
    want = clip_ref(own)  # the step as backward left it, clipped
    assert norm([a - b for a, b in zip(received[SPIKE_AT], want)]) / norm(want) < 1e-6
    assert dict(tracker.metrics)[SPIKE_AT]["surgery/applied"] == 0.0
    assert "surgery    nothing removed: no culprit found" in out.getvalue()


@pytest.mark.parametrize("clip", [True, False], ids=["clipper", "no-clipper"])
def test_the_console_block_shows_what_surgery_removed(tmp_path, clip):
    """... and what gets the operated gradient next: the clipper, or the optimizer itself when nothing clips
    (it said "then to the clipper" with no clipper; a framework's own clipping, Lightning's, may still follow)."""
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T)
    out = io.StringIO()
    received, own, cut, spike, _ = run(model, 1, console=TrainConsole(stream=out, rich=False), run_dir=tmp_path,
                                       clip=clip)
    text = out.getvalue()
    assert f"removed {spike.surgery.removed_share:.0%} of the step's squared grad norm" in text
    then = "the clipper" if clip else "the optimizer's step (no gradloc-track clipper)"  # (a framework may clip)
    assert f"grad norm {spike.surgery.grad_norm_pre:.3g} -> {spike.surgery.grad_norm_post:.3g}, then to {then}" \
        in text
    if not clip:  # the optimizer got the operated gradient as it is
        operated = [g - c for g, c in zip(own, cut)]
        assert norm([a - b for a, b in zip(received[SPIKE_AT], operated)]) / norm(operated) < 1e-6


def test_surgery_needs_the_detector_and_the_localizer():
    with pytest.raises(ConfigError, match=r"spikes.response='cut' is invalid: use one of 'none', 'surgery'"):
        SpikeConfig(response="cut")
    with pytest.raises(ConfigError, match=r"locate.enabled=False is invalid: spikes.response=surgery removes"):
        RootConfig(spikes=SpikeConfig(response="surgery"), locate=LocateConfig(enabled=False))
    with pytest.raises(ConfigError, match=r"spikes.enabled=False is invalid: spikes.response=surgery needs"):
        RootConfig(spikes=SpikeConfig(enabled=False, response="surgery"))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"locate.enabled=False is invalid"):
        GradMonitor(model, detector=SpikeDetector(SpikeConfig(response="surgery")),
                    locate_config=LocateConfig(enabled=False))
    with pytest.raises(ConfigError, match=r"spikes.enabled=False is invalid"):
        GradMonitor(model, detector=SpikeConfig(enabled=False, response="surgery"))


def test_hydra_composes_the_response():
    from hydra import compose, initialize_config_dir

    from gradloc_track.config import to_config
    from gradloc_track.demo.config import register_configs

    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = to_config(compose("config", overrides=["spikes.response=surgery", "clip=adagc"]))
        assert cfg.spikes.response == "surgery" and cfg.clip.kind == "adagc"
        with pytest.raises(ConfigError, match="locate.enabled"):
            to_config(compose("config", overrides=["spikes.response=surgery", "locate.enabled=false"]))
