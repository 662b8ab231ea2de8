"""Cost of gradient monitoring per training step, on a 6.2M-parameter GPT on CPU.

Variants, measured interleaved in one run, each against the same plain step (fwd+bwd+AdamW):
(a) the GradMonitor logging every step to a MemoryTracker; (b) a naive per-parameter ``.item()``
loop computing the same metrics; (c) ``wandb.watch(log="gradients", log_freq=1)`` offline;
(d) ``gradloc_track.watch(model, opt)`` logging every step (the optimizer pre-hook, batch capture
and the armed spike detector's per-step context; localization off so a chance spike does not
land in the timing), against a twin copy's plain step.
Reported: medians and the median of per-pair ratios (each variant step timed right next to its
plain step), then the extra call alone (the figure that survives a busy machine).

A second table puts ``watch()``'s fixed per-step cost where it shows: small models (a 2-layer
d=64 and a 4-layer d=256 GPT), ``watch()`` with its defaults (logging every step, detector armed,
localizer on) joining the user's ``mlflow.start_run()`` on a real SQLite store, on random batches
that hold no spike (the events column says so), against a twin's plain step; ``wandb.watch`` (offline)
beside it; the MLflow requests those steps cost, the CPU of whole blocks of steps (the writer's
requests included) and the optimizer hook alone.

    python benchmarks/bench_monitor.py [--rounds 20] [--batch 4] [--seq 256] [--threads N] [--no-wandb]
    python benchmarks/bench_monitor.py --only small [--rounds 40] [--server]
    python benchmarks/bench_monitor.py --only parts [--rounds 30] [--log-every 10] [--layers 4]
    python benchmarks/bench_monitor.py --only hooks [--layers 4]

``--only parts`` takes a small model's per-step cost apart (``--layers 2``, the default, or ``4``):
``watch()`` with its defaults, with one signal off at a time, with all three off, and with the detector off
(``spikes=False``), each beside a plain twin in one round-robin, into a ``MemoryTracker`` (no backend's
cost), in training-thread CPU; and the floor: a plain step plus only the reads the defaults need, without
their bookkeeping. ``--only hooks`` times each of ``watch()``'s hooks within the step (the defaults).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import math
import os
import sys
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved  # noqa: E402

import gradloc_track  # noqa: E402
from gradloc_track import GradMonitor, MemoryTracker  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402
from gradloc_track.grouping import layer_of  # noqa: E402


def make_step(model, batch, extra=None, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch[:, :-1], batch[:, 1:]

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        if extra is not None:
            extra(i)
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--only", choices=["small", "parts", "hooks"], default=None,
                    help="only the small-model watch() table, or only a small model's per-step parts (--layers), or "
                         "only the time each of watch()'s hooks takes a step (--layers)")
    ap.add_argument("--server", action="store_true",
                    help="--only small: log into a real `mlflow server` on 127.0.0.1, not an in-process store")
    ap.add_argument("--layers", type=int, choices=[m[0] for m in SMALL], default=SMALL[0][0],
                    help="--only parts: the small model taken apart (2: d=64, 4: d=256)")
    ap.add_argument("--log-every", type=int, default=1,
                    help="monitor.log_every of watch() in the small table and the --only parts variants")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only == "parts":
        step_parts(args)
        return
    if args.only == "hooks":
        hook_times(args)
        return
    small_models(args)
    if args.only == "small":
        return
    torch.manual_seed(0)
    proto = TinyGPT(vocab_size=256, n_layer=6, n_head=6, d_model=288, max_seq_len=args.seq)
    n_params = sum(p.numel() for p in proto.parameters())
    batch = torch.randint(0, 256, (args.batch, args.seq + 1))
    # base, monitor and naive share ONE model and optimizer: they differ only by the extra call
    # (separate copies differ by a few % from memory placement alone, which is noise, not cost)
    shared = copy.deepcopy(proto)
    opt = torch.optim.AdamW(shared.parameters(), lr=1e-4)
    models = {"watch": copy.deepcopy(proto), "watch_base": copy.deepcopy(proto)}
    monitor = GradMonitor(shared, tracker=MemoryTracker(), log_every=1)
    naive_tracker = MemoryTracker()

    layer = {n: layer_of(n) for n, _ in shared.named_parameters()}

    def naive(i: int) -> None:
        """The same metrics the monitor logs, the usual way: one ``.item()`` (sync) per tensor."""
        g_sq: dict[str, float] = {}
        w_sq: dict[str, float] = {}
        for n, p in shared.named_parameters():
            g, w = p.grad.norm().item(), p.detach().norm().item()  # two host syncs per tensor
            g_sq[layer[n]] = g_sq.get(layer[n], 0.0) + g * g
            w_sq[layer[n]] = w_sq.get(layer[n], 0.0) + w * w
        metrics = {"grad_norm/global": math.sqrt(sum(g_sq.values())),
                   "weight_norm/global": math.sqrt(sum(w_sq.values()))}
        for lay in g_sq:
            metrics[f"grad_norm/{lay}"] = math.sqrt(g_sq[lay])
            metrics[f"weight_norm/{lay}"] = math.sqrt(w_sq[lay])
            metrics[f"grad_weight_ratio/{lay}"] = math.sqrt(g_sq[lay] / max(w_sq[lay], 1e-24))
        naive_tracker.log_metrics(metrics, i)

    pairs = {  # variant -> (its step, the plain step it is compared with)
        "GradMonitor, logging every step": (make_step(shared, batch, monitor.after_backward, opt=opt), "shared"),
        "naive per-parameter .item() loop": (make_step(shared, batch, naive, opt=opt), "shared"),
    }
    bases = {"shared": make_step(shared, batch, opt=opt)}
    # watch() hooks its model and optimizer for good: its baseline is a twin copy's plain step
    gl_model, gl_twin = copy.deepcopy(proto), copy.deepcopy(proto)
    gl_opt = torch.optim.AdamW(gl_model.parameters(), lr=1e-4)
    gradloc_track.watch(gl_model, gl_opt, tracker=MemoryTracker(), log_every=1, locate=False)
    bases["watch() twin"] = make_step(gl_twin, batch)
    pairs["gradloc_track.watch(), logging every step"] = (make_step(gl_model, batch, opt=gl_opt), "watch() twin")
    run = None
    if not args.no_wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run = wandb.init(project="gradloc-bench", dir=tempfile.mkdtemp(), mode="offline")
        run.watch(models["watch"], log="gradients", log_freq=1)  # hooks stay on that copy
        # wandb.watch hooks a model for good: its baseline is a twin copy logging the same step
        bases["watch twin"] = make_step(models["watch_base"], batch, lambda i: run.log({"step": i}))
        pairs["wandb.watch(log='gradients', log_freq=1), offline"] = (
            make_step(models["watch"], batch, lambda i: run.log({"step": i})), "watch twin")
    print(f"model: {n_params / 1e6:.1f}M parameters, batch {args.batch}x{args.seq}, "
          f"torch threads {torch.get_num_threads()}, rounds {args.rounds}")
    res = paired(pairs, bases, args.rounds)
    print("\nstep = fwd+bwd+AdamW; each variant timed right next to its plain step, round-robin")
    print(f"{'variant':<52}{'plain ms':>9}{'variant ms':>11}{'ratio':>8}")
    for name, (tb, tv, ratio) in res.items():
        print(f"{name:<52}{tb * 1e3:>9.1f}{tv * 1e3:>11.1f}{ratio:>8.3f}")
    # the extra work alone, interleaved, on the gradients the last step left: the stable figure
    alone = interleaved({"monitor": monitor.after_backward, "naive": naive}, 50)
    base = statistics.median([tb for tb, _, _ in res.values()])
    print()
    for name, t in alone.items():
        print(f"{name} call alone: {t * 1e3:.2f} ms = {t / base:.2%} of the plain step")
    if run is not None:
        run.finish()


SMALL = ((2, 64, 2), (4, 256, 4))  # (layers, d_model, heads): where a fixed per-step cost shows


def small_models(args) -> None:
    """``watch()`` logging every step (or every ``--log-every``) inside ``mlflow.start_run()`` (the real SQLite
    store in this process, or with ``--server`` a real ``mlflow server`` over one; the user's run joined), and
    ``wandb.watch`` (offline) beside it, each against a twin's plain step."""
    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers.quiet import quiet_backend_noise

    quiet_backend_noise()
    requests = count_calls(MlflowClient, "log_batch")
    gen = torch.Generator().manual_seed(1)  # never the same batch twice in a run: nothing memorized, no spike
    pool = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen) for _ in range(1024)]
    store = tempfile.mkdtemp(prefix="bench-monitor-")
    with contextlib.ExitStack() as stack:
        uri = f"sqlite:///{store}/mlflow.db"
        if args.server:  # a real ``mlflow server`` on 127.0.0.1 over the same kind of store: its work runs there
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.conftest import running_mlflow_server

            uri = stack.enter_context(running_mlflow_server(uri, Path(store)))
        _small_models(args, requests, pool, store, uri)


def _small_models(args, requests, pool, store: str, uri: str) -> None:
    """``small_models``' table, logging to ``uri``."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("bench-monitor")
    where = "an mlflow server on 127.0.0.1, SQLite behind it" if args.server else "SQLite store"
    cadence = "every step" if args.log_every == 1 else f"every {args.log_every} steps"
    print(f"\nwatch() with its defaults (logging {cadence}, detector armed) inside mlflow.start_run() ({where})"
          f"{'' if args.no_wandb else ', wandb.watch(log_freq=1) offline'}, each against a twin's plain "
          f"step, batch {args.batch}x{args.seq}, rounds {args.rounds * 2}")
    print(f"{'model':<26}{'variant':<16}{'plain ms':>9}{'variant ms':>11}{'ratio':>7}{'cpu':>7}{'run cpu':>9}"
          f"{'hook ms':>9}{'hook cpu':>9}{'requests':>22}{'events':>7}")
    wandb_run, floors = None, []
    with mlflow.start_run():
        models = []
        for n_layer, d_model, n_head in SMALL:
            torch.manual_seed(0)
            proto = TinyGPT(vocab_size=256, n_layer=n_layer, n_head=n_head, d_model=d_model, max_seq_len=args.seq)
            name = f"{n_layer}-layer d={d_model} ({sum(p.numel() for p in proto.parameters()) / 1e6:.2f}M)"
            # joins the MLflow run only
            models.append((name, proto, {"watch() MLflow": watch_arm(proto, pool, args.log_every)}))
        if not args.no_wandb:  # opened after every watch(): ours do not join it
            wandb_run = open_wandb(store)
            for _, proto, arms in models:
                arms["wandb.watch"] = wandb_arm(proto, pool, wandb_run)
        for name, _, arms in models:
            pairs = {k: (arm.step, k) for k, arm in arms.items()}
            n0, v0, t0 = requests.n, requests.values, time.perf_counter()
            res = paired(pairs, {k: arm.base for k, arm in arms.items()}, args.rounds * 2, cpu=True)
            steps = args.rounds * 2 + 2
            sent = f"{requests.n - n0}/{steps} steps, {time.perf_counter() - t0:.0f} s"
            floors.append((name, (requests.values - v0) / steps, res["watch() MLflow cpu"][0]))
            for label, arm in arms.items():
                (tb, tv, ratio), cpu = res[label], res[label + " cpu"][2]
                run_cpu = whole_run_cpu(arm, args.rounds)
                wall, thread = arm.hook()
                ours = label.startswith("watch")
                print(f"{name if ours else '':<26}{label:<16}{tb * 1e3:>9.1f}{tv * 1e3:>11.1f}{ratio:>7.3f}"
                      f"{cpu:>7.3f}{run_cpu:>9.3f}{wall * 1e3:>9.2f}{thread * 1e3:>9.2f}{sent if ours else '':>22}"
                      f"{arm.events():>7}")
                arm.close()
        per_value, per_request = store_cpu_per_value(), store_cpu_per_request()
    if wandb_run is not None:
        wandb_run.finish()
    alone = "this process's CPU (the client's) through the server" if args.server else "MLflow's SQLite store alone"
    adds = "what logging through it adds to this process's step" if args.server else \
        "what any in-process writer adds to a step"
    print(f"{alone}: {per_value * 1e6:.0f} us CPU per metric value (log_batch of 975 values, same store), "
          f"{per_request * 1e3:.2f} ms per request (of one value); {adds}, whatever it batches:")
    for name, values, plain_cpu in floors:
        print(f"  {name}: {values:.0f} values per step -> {values * per_value * 1e3:.2f} ms, "
              f"run cpu >= {1 + values * per_value / plain_cpu:.3f} (plain step {plain_cpu * 1e3:.1f} ms CPU)")
    print("ratio: median of per-pair wall-time ratios; cpu: the same in process CPU time; run cpu: process CPU "
          "of blocks of 30 steps, the writer's flush inside the block (what the writer's requests cost "
          "in all; W&B's own service process is not counted); hook: what the optimizer hook runs, alone "
          "(wall, and CPU of the training thread); requests: MLflow log_batch requests while the pairs ran")


PARTS = {  # variant -> watch() options (None: the plain twin)
    "plain step": None,
    "watch() defaults": {},
    "  sample signal off": {"spikes": {"sample_signal": False}},
    "  junk signal off": {"spikes": {"junk_signal": False}},
    "  update signal off": {"spikes": {"update_signal": False}},
    "  all three off": {"spikes": {"sample_signal": False, "junk_signal": False, "update_signal": False}},
    "  detector off (spikes=False)": {"spikes": False},
}


def step_parts(args) -> None:
    """What each default costs a step of a small model (``--layers``: the 2-layer d=64 one by default): every
    variant of ``PARTS`` on its own copy, round-robin (the order reversed every other round), training-thread CPU
    per step, medians."""
    n_layer, d_model, n_head = next(m for m in SMALL if m[0] == args.layers)
    torch.manual_seed(0)
    proto = TinyGPT(vocab_size=256, n_layer=n_layer, n_head=n_head, d_model=d_model, max_seq_len=args.seq)
    gen = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen) for _ in range(256)]
    steps = {}
    for name, options in PARTS.items():
        model = copy.deepcopy(proto)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if options is not None:
            gradloc_track.watch(model, opt, tracker=MemoryTracker(), log_every=args.log_every, console=False,
                                **options)
        steps[name] = rotating_step(model, opt, pool)
    model = copy.deepcopy(proto)
    steps["the defaults' reads alone"] = reads_alone_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), pool)
    med = interleaved(steps, args.rounds * 2, warmup=3, clock=time.thread_time)
    plain = med["plain step"]
    print(f"{n_layer}-layer d={d_model} GPT, batch {args.batch}x{args.seq}, torch threads {torch.get_num_threads()}, "
          f"log_every {args.log_every}, {args.rounds * 2} rounds; training-thread CPU per step, medians")
    print(f"{'variant':<34}{'ms':>8}{'over plain ms':>15}{'ratio':>8}")
    for name, t in med.items():
        print(f"{name:<34}{t * 1e3:>8.2f}{(t - plain) * 1e3:>15.2f}{t / plain:>8.3f}")


def hook_times(args, steps: int = 300, warmup: int = 50) -> None:
    """Where ``watch()``'s per-step cost is, by hook: each hook's training-thread CPU a step (medians over ``steps``
    steps of the ``--layers`` model with the defaults, into a ``MemoryTracker``): the forward's input hook (the batch
    capture), its output hook (the sample and junk statistics from the logits), the hook on the logits' gradient
    (which positions the user's loss has terms at), the optimizer's pre-step hook (norms, clipping, the transfer,
    the detector's verdict) and its post-step hook (the update signal's moments); beside them, inside the pre-step
    hook, the norm pass alone."""
    from gradloc_track.integrations import batches, handle
    from gradloc_track.monitor import adam_update, grad_monitor

    times: dict[str, list[float]] = {}

    def timed(key, fn):
        def run(*a, **k):
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                times.setdefault(key, []).append(time.thread_time() - c0)
        return run

    patches = [(batches.MicroBatchCapture, "_record", "forward input hook (capture)"),
               (batches.MicroBatchCapture, "_check_output", "forward output hook (signals)"),
               (handle.WatchHandle, "_pre_step", "optimizer pre-step hook"),
               (grad_monitor.GradMonitor, "_global_sq_norms", "  of which the norm pass"),
               (adam_update.AdamUpdate, "_after_step", "optimizer post-step hook")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    real_terms = batches.watch_terms

    def watch_terms(batch, logits):  # the hook it registers on the logits, timed
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            register = logits.register_hook
            logits.register_hook = lambda fn: register(timed("logits' gradient hook (terms)", fn))
        real_terms(batch, logits)

    try:
        for owner, name, key in patches:
            setattr(owner, name, timed(key, getattr(owner, name)))
        batches.watch_terms = watch_terms
        n_layer, d_model, n_head = next(m for m in SMALL if m[0] == args.layers)
        torch.manual_seed(0)
        model = TinyGPT(vocab_size=256, n_layer=n_layer, n_head=n_head, d_model=d_model, max_seq_len=args.seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        pool = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen) for _ in range(64)]
        gradloc_track.watch(model, opt, tracker=MemoryTracker(), log_every=args.log_every, console=False)
        step, whole = rotating_step(model, opt, pool), []
        for i in range(warmup + steps):
            c0 = time.thread_time()
            step(i)
            whole.append(time.thread_time() - c0)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        batches.watch_terms = real_terms
    print(f"{n_layer}-layer d={d_model} GPT, batch {args.batch}x{args.seq}, torch threads {torch.get_num_threads()}, "
          f"log_every {args.log_every}, watch() defaults, {steps} steps; training-thread CPU per step, medians")
    print(f"{'hook':<36}{'ms':>8}")
    total = 0.0
    for key in [k for _, _, k in patches[:2]] + ["logits' gradient hook (terms)"] + [k for _, _, k in patches[2:]]:
        ms = statistics.median(times.get(key, [0.0])[warmup:]) * 1e3
        total += 0.0 if key.startswith("  ") else ms
        print(f"{key:<36}{ms:>8.3f}")
    print(f"{'the hooks together':<36}{total:>8.3f}")
    print(f"{'the whole step':<36}{statistics.median(whole[warmup:]) * 1e3:>8.3f}")


def reads_alone_step(model, opt, pool):
    """A plain step plus only what the defaults must read, with no bookkeeping: the logits' per-term loss and
    excess (``log_softmax``, a sum, two gathers), one norm pass over the gradients and weights, one host
    transfer, and the ``exp_avg`` norm pass after the optimizer's step: the floor of the defaults' cost."""
    params = list(model.parameters())

    def step(i: int) -> None:
        batch = pool[i % len(pool)]
        opt.zero_grad(set_to_none=True)
        logits = model(batch[:, :-1])
        with torch.no_grad():
            flat, tgt = logits.detach().reshape(-1, 256), batch[:, 1:].reshape(-1, 1)
            terms = torch.stack([flat.sum(-1), flat.gather(1, tgt)[:, 0],
                                 torch.log_softmax(flat, -1).gather(1, tgt)[:, 0]])
        F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
        with torch.no_grad():
            norms = torch.stack(torch._foreach_norm([p.grad for p in params] + params))
            torch.cat([norms, terms.sum(1)]).tolist()
        opt.step()
        with torch.no_grad():
            torch._foreach_norm([opt.state[p]["exp_avg"] for p in params])
    return step


class Arm:
    """One measured variant: its step, its twin's plain step, its hook alone (wall and thread CPU
    seconds), its flush, its spike events, and how to take it off."""

    def __init__(self, step, base, hook=lambda: (math.nan, math.nan), flush=None, events=lambda: "",
                 close=lambda: None) -> None:
        self.step, self.base, self.hook, self.flush, self.events, self.close = step, base, hook, flush, events, close


def rotating_step(model, opt, pool, extra=None):
    def step(i: int) -> None:
        batch = pool[i % len(pool)]  # random tokens: no spike to find
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
        opt.step()
        if extra is not None:
            extra(i)
    return step


def twin_step(proto, pool, extra=None):
    twin = copy.deepcopy(proto)
    return rotating_step(twin, torch.optim.AdamW(twin.parameters(), lr=1e-4), pool, extra)


def watch_arm(proto, pool, log_every: int = 1) -> Arm:
    """``gradloc_track.watch()`` joining the open MLflow run."""
    model = copy.deepcopy(proto)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    handle = gradloc_track.watch(model, opt, log_every=log_every)

    def hook() -> tuple[float, float]:
        alone = []
        for i in range(30):  # what the optimizer hook runs, alone, on a fresh backward, the writer running
            batch = pool[-1 - i]
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
            t0, c0 = time.perf_counter(), time.thread_time()
            handle.step()
            alone.append((time.perf_counter() - t0, time.thread_time() - c0))
        return statistics.median(w for w, _ in alone), statistics.median(c for _, c in alone)

    def close() -> None:
        handle.remove()
        handle.finish()
    return Arm(rotating_step(model, opt, pool), twin_step(proto, pool), hook, handle.flush,
               lambda: len(handle.spikes), close)


def open_wandb(store: str):
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    return wandb.init(project="gradloc-bench", dir=store, mode="offline")


def wandb_arm(proto, pool, run) -> Arm:
    """``wandb.watch(log="gradients", log_freq=1)``; model and twin both log one row per step."""
    model = copy.deepcopy(proto)
    run.watch(model, log="gradients", log_freq=1)  # hooks stay on that copy
    row = lambda i: run.log({"step": i})  # noqa: E731 - what makes wandb.watch log: a row per step
    return Arm(rotating_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), pool, row),
               twin_step(proto, pool, row), close=lambda: run.unwatch(model))


def whole_run_cpu(arm: Arm, rounds: int, block: int = 30) -> float:
    """Median ratio of process CPU time over blocks of ``block`` steps (variant, flushed, vs plain)."""
    ratios, i = [], 512  # (batches the pairs did not use)
    for r in range(max(3, rounds // 4)):
        t = {}
        for tag, fn in (("v", arm.step), ("b", arm.base)) if r % 2 else (("b", arm.base), ("v", arm.step)):
            t0 = time.process_time()
            for _ in range(block):
                fn(i)
                i += 1
            if tag == "v" and arm.flush is not None:
                arm.flush()  # the writer's work for these steps is done inside the block
            t[tag] = time.process_time() - t0
        ratios.append(t["v"] / t["b"])
    return statistics.median(ratios)


class count_calls:
    """Counts calls of ``cls.name`` (from any thread) and the metric values they carry."""

    def __init__(self, cls, name: str) -> None:
        self.n, self.values, real = 0, 0, getattr(cls, name)

        def counted(client, run_id, metrics=(), *a, **k):
            self.n += 1
            self.values += len(metrics)
            return real(client, run_id, metrics, *a, **k)
        setattr(cls, name, counted)


def store_cpu_per_value(n: int = 975, repeats: int = 3) -> float:
    """MLflow's own CPU seconds per metric value: ``log_batch`` of ``n`` values into the open run's store."""
    return statistics.median(_log_batch_cpu(n) / n for _ in range(repeats))


def store_cpu_per_request(repeats: int = 5) -> float:
    """MLflow's own CPU seconds of a ``log_batch`` request of one value: what a request costs beyond its values."""
    return statistics.median(_log_batch_cpu(1) for _ in range(repeats))


_BATCHES = itertools.count(1)  # log_batch calls made by the two above (each call's values at new steps)


def _log_batch_cpu(n: int) -> float:
    """Process CPU seconds of one ``log_batch`` of ``n`` values (25 keys) into the open run."""
    import mlflow
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(), mlflow.active_run().info.run_id
    r = next(_BATCHES)
    batch = [Metric(f"store/m{k % 25}", 1.0, 1000 + r, 10_000 * r + k // 25) for k in range(n)]
    t0 = time.process_time()
    client.log_batch(run_id, metrics=batch, synchronous=True)
    return time.process_time() - t0


def paired(pairs, bases, rounds: int, warmup: int = 2, cpu: bool = False) -> dict[str, tuple[float, float, float]]:
    """Per variant: median plain-step seconds, median variant seconds, median of per-pair ratios
    (``cpu``: also ``"<variant> cpu"``, the same in process CPU time).

    Each variant step runs right next to its own plain step (order alternating), so slow drifts
    of a shared machine cancel in the ratio of each pair.
    """
    for i in range(warmup):
        for fn, b in pairs.values():
            bases[b](i)
            fn(i)
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in pairs}
    cpus: dict[str, list[tuple[float, float]]] = {k: [] for k in pairs}
    i = warmup
    for r in range(rounds):
        for name, (fn, b) in pairs.items():
            order = [("v", fn), ("b", bases[b])] if r % 2 else [("b", bases[b]), ("v", fn)]
            t, c = {}, {}
            for tag, f in order:
                c0, t0 = time.process_time(), time.perf_counter()
                f(i)
                t[tag], c[tag] = time.perf_counter() - t0, time.process_time() - c0
                i += 1
            out[name].append((t["b"], t["v"]))
            cpus[name].append((c["b"], c["v"]))
    res = {k: _medians(v) for k, v in out.items()}
    if cpu:
        res.update({f"{k} cpu": _medians(v) for k, v in cpus.items()})
    return res


def _medians(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    return (statistics.median(b for b, _ in pairs), statistics.median(x for _, x in pairs),
            statistics.median(x / max(b, 1e-9) for b, x in pairs))


if __name__ == "__main__":
    main()
