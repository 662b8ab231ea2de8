"""How often the spike detector fires on CLEAN training, at small and large batches.

Trains the demo model (``gradloc_track.demo``, the ``model=tiny`` config, tracker off, detector and
localizer on, nothing injected) for ``--steps`` steps at each ``BxT`` and reads back its
``metrics.jsonl``: detector events, localizations and how many of them found a culprit. The
per-step global/per-layer grad norms and token counts are saved to ``--cache`` so that
``--replay`` re-runs only the CURRENT detector over the recorded streams (the detector observes,
it does not change training, so a replay sees exactly what a live run would).

    PYTHONPATH=. python benchmarks/detector_calibration.py                  # record + count
    PYTHONPATH=. python benchmarks/detector_calibration.py --replay         # detector only, seconds
    PYTHONPATH=. python benchmarks/detector_calibration.py --shapes 4x32 --steps 500
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from gradloc_track.config import SpikeConfig
from gradloc_track.demo.config import DemoConfig, TrainConfig
from gradloc_track.spikes import SpikeDetector

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "gradloc-track-detector-streams"


def _example_app():
    """``examples/train_lm.py``, the demo's training loop, as a module."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("example_train_lm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


def record(b: int, t: int, steps: int, cache: Path, threads: int | None) -> dict:
    """Train the demo cleanly with the default detector; return counts and save the streams."""
    train_lm = _example_app().train_lm

    cfg = DemoConfig(train=TrainConfig(steps=steps, batch_size=b, seq_len=t, num_threads=threads))
    run_dir = Path(tempfile.mkdtemp(prefix=f"detcal-{b}x{t}-"))
    t0 = time.perf_counter()
    train_lm(cfg, run_dir)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = {}
    for r in rows:  # a step can be logged in several records (train/loss comes separately)
        per_step.setdefault(r["step"], {}).update(r["metrics"])
    stream = []
    located = found = 0
    for step in sorted(per_step):
        m = per_step[step]
        if "grad_norm/global" not in m:
            continue  # the summary record
        layers = {k[len("grad_norm/"):]: v for k, v in m.items()
                  if k.startswith("grad_norm/") and k not in ("grad_norm/global", "grad_norm/nonfinite")
                  and not k.startswith("grad_norm/tensor/")}
        stream.append({"step": step, "global": m["grad_norm/global"], "layers": layers, "n_tokens": b * t})
        if "locate/culprits" in m:
            located += 1
            found += m["locate/culprits"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"{b}x{t}.json").write_text(json.dumps(stream))
    return {"events": len(summary["events_at"]), "events_at": summary["events_at"][:12], "localized": located,
            "found_culprit": found, "seconds": round(seconds, 1)}


def replay(stream: list[dict], cfg: SpikeConfig | None = None) -> dict:
    """Run a fresh detector over a recorded stream; count the steps it fires on."""
    det = SpikeDetector(cfg or SpikeConfig())
    at = [r["step"] for r in stream if det.update(r["step"], r["global"], r["layers"], n_tokens=r["n_tokens"])]
    return {"events": len(at), "events_at": at[:12]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x32,16x128")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--replay", action="store_true", help="only replay the detector over cached streams")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        b, t = map(int, shape.split("x"))
        if args.replay:
            stream = json.loads((args.cache / f"{b}x{t}.json").read_text())
            print(f"{shape}: {len(stream)} recorded steps, detector replay: {replay(stream)}", flush=True)
        else:
            print(f"{shape}: live run: {record(b, t, args.steps, args.cache, args.threads)}", flush=True)


if __name__ == "__main__":
    main()
