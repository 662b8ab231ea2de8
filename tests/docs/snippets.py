"""Console output quoted in README.md and docs/*.md, generated from the runs the suite makes.

A quoted output sits between two markers in the Markdown (HTML comments: invisible on GitHub)::

    <!-- snippet: demo-console -->
    ```text
    ...what the run printed, normalized...
    ```
    <!-- /snippet -->

A number from a run in the prose sits between two inline markers, ``<!-- fact: demo-threshold -->2.60
before step 100<!-- /fact -->``, made by ``FACTS``.

``SNIPPETS`` maps each name to the function that makes its text from a run (``Runs``: the demo, the
TRL example, each run once). ``tests/docs/test_snippets.py`` fails when a quoted text is no longer
what the run prints; ``python -m tests.docs.snippets`` (from the repository root) rewrites every
marked block from fresh runs. What differs from machine to machine or run to run (temporary
paths, run ids, start times, seconds) is normalized to the placeholders a reader sees in the docs.

Numbers are compared as printed: a rounded number (``90%``, ``z = 7``, ``1.23``) must match exactly. A
number written to full float precision (``"max_share": 0.9041699414420074``, a JSON file's) carries
digits that move with the CPU's vector kernels and summation order: it matches within a relative
``FULL_PRECISION_TOLERANCE``, and a rewrite keeps the quoted one.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- snippet: (?P<name>[\w-]+) -->\n```(?P<lang>\w*)\n)(?P<body>.*?)(```\n<!-- /snippet -->)",
                   re.S)
FACT = re.compile(r"(<!-- fact: (?P<name>[\w-]+) -->)(?P<body>.*?)(<!-- /fact -->)", re.S)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
FULL_PRECISION_DIGITS = 9  # significant digits no console or page rounds to: a float written as it is
FULL_PRECISION_TOLERANCE = 1e-3  # relative: what another CPU's summation order moves such a float by, with margin


def _full_precision(number: str) -> bool:
    return len(re.sub(r"e.*$|[-.]", "", number).lstrip("0")) >= FULL_PRECISION_DIGITS


def same(quoted: str, fresh: str) -> bool:
    """``quoted`` says what ``fresh`` says: equal text around the numbers, rounded numbers equal, full-precision
    ones within ``FULL_PRECISION_TOLERANCE`` (see the module doc)."""
    q_text, f_text = NUMBER.split(quoted), NUMBER.split(fresh)
    q_num, f_num = NUMBER.findall(quoted), NUMBER.findall(fresh)
    if q_text != f_text or len(q_num) != len(f_num):
        return False
    for a, b in zip(q_num, f_num):
        if a == b:
            continue
        if not (_full_precision(a) and _full_precision(b)):
            return False
        if abs(float(a) - float(b)) > FULL_PRECISION_TOLERANCE * max(abs(float(a)), abs(float(b))):
            return False
    return True


def normalize(text: str, root: Path) -> str:
    """Paths under the run's temporary root, MLflow ids, start times and durations as the docs write them."""
    text = text.replace(f"sqlite:///{root}/mlflow.db", "sqlite:///<the folder you ran it from>/mlflow.db")
    text = text.replace(str(root) + "/", "")
    # Hydra's run dirs (runs/<stamp>) and the argparse examples' (runs/<example>/<stamp>)
    text = re.sub(r"\b(runs/(?:[\w-]+/)?)\d{4}-\d\d-\d\d_[\d_-]+", r"\1<date>", text)
    text = re.sub(r"/#/experiments/\d+/", "/#/experiments/<id>/", text)
    text = re.sub(r"\b[0-9a-f]{32}\b", "<run id>", text)
    text = re.sub(r"\d\d-\d\d \d\d:\d\d:\d\d", "<time>", text)
    text = re.sub(r"held up [\d.]+ normal steps(.*)after it: [-+][\d.]+ against",  # the demo's spike pause: timing
                  r"held up <n> normal steps\1after it: <n> against", text)
    return re.sub(r"steps in \d+ s", "steps in <s> s", text)


def console_tail(console: str, root: Path, first: str) -> str:
    """The console from the line starting with ``first`` on: the spike block and the summary (progress lines,
    W&B's lines and warnings left out)."""
    lines = console.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(first))
    keep = [ln for ln in lines[start:] if not re.match(r"\[ *\d+/\d+\] step ", ln) and "W&B run" not in ln
            and "wandb sync" not in ln and "Warning" not in ln and not ln.startswith(("  warnings.warn", "[INFO]"))]
    return normalize("\n".join(keep), root) + "\n"


class Runs:
    """The runs the snippets quote, each made on first use (``demo``: the README's command)."""

    def __init__(self, make_demo: Callable[[], object], make_trl: Callable[[], tuple[str, Path]]) -> None:
        self._make = {"demo": make_demo, "trl": make_trl}
        self._done: dict[str, object] = {}

    def get(self, name: str):
        if name not in self._done:
            self._done[name] = self._make[name]()
        return self._done[name]


def demo_console(runs: Runs) -> str:
    demo = runs.get("demo")
    return console_tail(demo.console, demo.root, "── spike at step")


def demo_blocklist(runs: Runs) -> str:
    """``gradloc-track culprits <the demo's run dir> --export-blocklist blocklist.json``: the file."""
    from gradloc_track.cli import main

    demo = runs.get("demo")
    out = demo.root / "ledger"
    assert main(["culprits", str(demo.run_dir), "-o", str(out), "--export-blocklist", str(out / "b.json")]) == 0
    data = json.loads((out / "b.json").read_text(encoding="utf-8"))
    return normalize(json.dumps(data, ensure_ascii=False, indent=1), demo.root) + "\n"


def trl_grpo_console(runs: Runs) -> str:
    console, root = runs.get("trl")
    return console_tail(console, root, "── spike at step")


def demo_metric(runs: Runs, key: str) -> dict[int, float]:
    """``key``'s values by step, as the demo run logged them to MLflow."""
    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers.run_record import read_run_views

    demo = runs.get("demo")
    view = read_run_views(demo.run_dir)["mlflow"]
    return {m.step: m.value for m in MlflowClient(view["tracking_uri"]).get_metric_history(view["run_id"], key)}


def demo_threshold(runs: Runs) -> str:
    """forensics.md: the detector's ``spike/threshold`` before the demo's spike and after it."""
    t = demo_metric(runs, "spike/threshold")
    return f"{t[99]:.2f} before step 100 and {t[101]:.2f} / {t[110]:.2f} one / ten steps after"


SNIPPETS: dict[str, Callable[[Runs], str]] = {
    "demo-console": demo_console,
    "demo-blocklist": demo_blocklist,
    "trl-grpo-console": trl_grpo_console,
}
FACTS: dict[str, Callable[[Runs], str]] = {
    "demo-threshold": demo_threshold,
}


def blocks(path: Path) -> list[tuple[str, str]]:
    """(name, body) of every marked block in ``path``."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(path.read_text(encoding="utf-8"))]


def facts(path: Path) -> list[tuple[str, str]]:
    """(name, text) of every marked fact in ``path``."""
    return [(m["name"], m["body"]) for m in FACT.finditer(path.read_text(encoding="utf-8"))]


def stale(runs: Runs, docs: list[Path] = DOCS) -> list[str]:
    """Every marked block or fact whose text is not what its run says now, as ``file: name``."""
    out = []
    for path in docs:
        for kind, known, found in (("snippet", SNIPPETS, blocks(path)), ("fact", FACTS, facts(path))):
            for name, body in found:
                if name not in known:
                    out.append(f"{path.name}: unknown {kind} {name!r} (known: {', '.join(known)})")
                elif not same(body, known[name](runs)):
                    out.append(f"{path.name}: {name}")
    return out


def _fresh(made: Callable[[Runs], str], runs: Runs, quoted: str) -> str:
    """The run's text, or the quoted one where it says the same (no churn from another CPU's last digits)."""
    text = made(runs)
    return quoted if same(quoted, text) else text


def rewrite(runs: Runs, docs: list[Path] = DOCS) -> list[str]:
    """Every marked block and fact rewritten from its run; the files changed."""
    changed = []
    for path in docs:
        text = path.read_text(encoding="utf-8")
        new = BLOCK.sub(lambda m: m.group(1) + _fresh(SNIPPETS[m["name"]], runs, m["body"]) + m.group(5), text)
        new = FACT.sub(lambda m: m.group(1) + _fresh(FACTS[m["name"]], runs, m["body"]) + m.group(4), new)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))
    return changed


def fresh_runs(base: Path) -> Runs:
    """The runs, made as the tests make them (``tests/examples/demo_run.py``, the TRL example's defaults)."""
    from tests.examples.demo_run import DemoRun, run_dirs, run_example

    def demo():
        root = base / "demo"
        root.mkdir()
        proc = run_example(root, "experiment=spike_demo", "tracker=both",
                           f"tracker.mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}")
        return DemoRun(root, proc, run_dirs(root)[0])

    return Runs(demo, lambda: run_trl_example(base / "trl"))


def run_trl_example(root: Path) -> tuple[str, Path]:
    """``python examples/trl_grpo.py --report-to none`` in ``root``: its console (run dir runs/trl_grpo/<date>)."""
    import os
    import subprocess

    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--report-to", "none"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"trl_grpo.py failed:\n{proc.stderr[-3000:]}")
    return proc.stdout, root  # the console (stderr: Trainer's and the libraries' warnings)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print("\n".join(rewrite(fresh_runs(Path(tmp)))) or "every snippet is up to date")
