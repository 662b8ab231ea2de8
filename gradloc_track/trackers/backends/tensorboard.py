"""TensorBoard (``tracker=tensorboard``): the adapter and its backend entry, in this one file.

A run is a log dir of event files: ``<run dir>/tensorboard`` when the run has a run dir, else
``./tensorboard/<time>_<run name>`` (a scratch run dir goes when the run ends; the log dir must not).
What is logged, and how TensorBoard shows it:

- metrics: scalars at the training step (the Scalars tab);
- a table ``key`` (``spikes/tokens``, ``spikes/events``): a text table at the event's step (the Text
  tab shows a 2-D text tensor as a table), and the same part as JSON under ``key/json`` (in a fenced
  block: readable there, exact for programs: the report and the ledger read it back);
- a page ``key`` (``spikes/highlight``): the culprit text as Markdown under ``key`` (TensorBoard shows
  Markdown, sanitized: no styles, so the culprit tokens are **bold**), the whole document under
  ``key/html`` (fenced: the report embeds it as it was);
- an image (``spikes/heatmap``): an image summary (the Images tab); params and tags: text tables;
- a file (``log_artifact``): copied into ``<log dir>/artifacts/``.

Every call writes to the event file and flushes it: a killed process loses nothing it logged. The
background writer (``AsyncTracker``) calls it like any backend; ``replay`` appends a new event file
to the same log dir (TensorBoard reads a log dir's files as one run). ``gradloc-track report`` and
``culprits`` read a run dir that logged here, or the log dir itself. A Lightning ``TensorBoardLogger``
is joined: our records go into its log dir.
"""
from __future__ import annotations

import html
import re
import time
from datetime import datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Mapping

from ..._optional import require
from ..table_json import dumps_table
from ..files import atomic_write_bytes
from ..naming import HTML_KEY, IMAGE_KEY
from ..interface import Tracker
from ..run_record import record_run
from .base import Backend, RunFiles, SpikeReader

EVENTS = "events.out.tfevents."
FENCE = re.compile(r"^(`{3,})[a-z]*\n(.*)\n\1$", re.S)
CULPRIT_CLASSES = {"c", "u"}  # the highlight page's culprit token (outlined) and culprit span/sample (dashed)
SKIPPED_TAGS = {"style", "script", "title", "head"}
BLOCK_TAGS = {"h1", "h2", "h3", "div", "p", "details", "summary", "br", "li", "tr"}


def fenced(text: str, lang: str) -> str:
    """``text`` in a fenced code block whose fence is longer than any run of backticks in it."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


# what Python-Markdown (TensorBoard's Text tab) reads as syntax after a backslash, and the tables extension's |
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()>#+\-.!|])")


def cell(value: Any) -> str:
    """A text table's cell as TensorBoard shows it (each cell is Markdown, sanitized): the text itself, never
    read as Markdown or HTML (held-out tester, stop 56: ``&amp;`` showed as ``&``, ``'><img src=x>`` became an
    image, a right-to-left override reordered the row); controls shown as the other views show them."""
    from ...text import visible_text

    return _MD_SPECIAL.sub(r"\\\1", html.escape(visible_text("" if value is None else str(value)), quote=False))


def unfenced(text: str) -> str:
    m = FENCE.match(text)
    return m.group(2) if m else text


class _Markdown(HTMLParser):
    """A highlight page as Markdown: its text, headings as headings, culprits in **bold**."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self._skip = 0
        self._stack: list[bool] = []  # per open span: a culprit?
        self._bold = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in SKIPPED_TAGS:
            self._skip += 1
        elif tag == "span":
            culprit = bool(CULPRIT_CLASSES & set((dict(attrs).get("class") or "").split()))
            self._stack.append(culprit)
            if culprit:
                self._bold += 1
                if self._bold == 1:
                    self.out.append("**")
        elif tag in BLOCK_TAGS:
            self.out.append("\n\n" + ("# " if tag == "h1" else "## " if tag in ("h2", "h3") else ""))

    def handle_endtag(self, tag: str) -> None:
        if tag in SKIPPED_TAGS:
            self._skip = max(0, self._skip - 1)
        elif tag == "span" and self._stack and self._stack.pop():
            self._bold -= 1
            if self._bold == 0:
                self.out.append("**")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            text = html.escape(" ".join(data.split()) if not data.strip() else data.replace("\n", " "), quote=False)
            self.out.append(re.sub(r"([\\`*_\[\]#|])", r"\\\1", text))


def page_markdown(page: str) -> str:
    """What TensorBoard's Text tab shows of a highlight page (Markdown; it drops every style)."""
    parser = _Markdown()
    parser.feed(page)
    parser.close()
    text = re.sub(r"\n{3,}", "\n\n", "".join(parser.out)).strip()
    return re.sub(r"\*\*\*\*", "", text)


def _png_size(data: bytes) -> tuple[int, int]:
    """(height, width) from a PNG's header; (0, 0) when it is not one."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or len(data) < 24:
        return 0, 0
    return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")


class TensorBoardTracker(Tracker):
    """Writes a TensorBoard log dir (see the module doc). ``logdir``: where; ``run_dir``: our own files for
    this run (the run record); ``run_name``: said in the record."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path, run_dir: str | Path | None = None, run_name: str | None = None,
                 attached: bool = False) -> None:
        require("tensorboard", "tensorboard")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.run_name, self.attached = run_name or self.logdir.name, attached  # attached: a Lightning logger's
        self._writer = EventFileWriter(str(self.logdir))
        self._step = 0
        self._last_part: tuple[str, int | None, list[list[Any]]] | None = None
        record_run(self.run_dir, self.name, {"logdir": str(self.logdir.resolve()), "run_name": self.run_name})

    def run_ref(self) -> dict[str, Any]:
        return {"logdir": str(self.logdir.resolve()), "run_name": self.run_name}

    def where(self) -> str:
        return f"TensorBoard log dir {self.logdir} (view it: tensorboard --logdir {self.logdir})"

    # -- writing ---------------------------------------------------------------------------------
    def _write(self, summary: Any, step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        step = self._step if step is None else int(step)
        self._step = max(self._step, step)
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()  # on disk now: a killed run keeps what it logged

    def _text(self, tag: str, value: Any, step: int | None) -> None:
        import numpy as np
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._write(text_pb(tag, np.asarray(value, dtype=object).astype(str)), step)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb

        values = [v for k, x in metrics.items() for v in scalar_pb(k, float(x)).value]
        self._write(Summary(value=values), step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        rows = [[cell(k), cell(v)] for k, v in params.items() if v is not None]
        if rows:
            self._text("params", [["param", "value"], *rows], 0)

    def log_table(self, key, columns, rows, step=None) -> None:
        rows = [list(r) for r in rows]
        if self._last_part is not None and self._last_part[:2] == (key, step):
            rows = self._last_part[2] + rows  # a second call for the same event: one part
        self._last_part = (key, step, rows)
        shown = [[cell(c) for c in columns], *[[cell(v) for v in r] for r in rows]]
        self._text(key, shown, step)
        self._text(f"{key}/json", fenced(dumps_table(columns, rows), "json"), step)

    def log_html(self, key, html, step=None) -> None:
        self._text(key, page_markdown(html) or "(empty page)", step)
        self._text(f"{key}/html", fenced(html, "html"), step)

    def log_image(self, key, path, step=None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        data = Path(path).read_bytes()
        height, width = _png_size(data)
        image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=data)
        self._write(Summary(value=[Summary.Value(tag=key, image=image)]), step)

    def log_artifact(self, path, artifact_path=None) -> None:
        path = Path(path)
        atomic_write_bytes(self.logdir / "artifacts" / (artifact_path or "") / path.name, path.read_bytes())

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._text("tags", [["tag", "value"], *[[cell(k), cell(v)] for k, v in tags.items()]], None)

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        if not self.attached:
            self._text("status", status, None)
        self._writer.close()


class EventFiles(SpikeReader):
    """A log dir's spike records, read back from its event files (every event, in step order)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        self.acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "images": 0, "scalars": 1},
                                    purge_orphaned_data=False)
        self.acc.Reload()
        self.tags = self.acc.Tags()

    def _texts(self, tag: str) -> dict[int, str]:
        from tensorboard.util import tensor_util

        if tag not in self.tags.get("tensors", []):
            return {}
        out: dict[int, str] = {}
        for ev in self.acc.Tensors(tag):  # the last one of a step wins (a part logged twice is one part)
            value = tensor_util.make_ndarray(ev.tensor_proto)
            cell = value.flat[0] if value.size else b""
            out[ev.step] = unfenced(cell.decode("utf-8", "replace") if isinstance(cell, bytes) else str(cell))
        return dict(sorted(out.items()))

    def has_spikes(self) -> bool:
        return any(t.startswith("spikes/") for t in self.tags.get("tensors", []))

    def tables(self, kind):
        return [(f"spikes/{kind}/json at step {step}", text.encode("utf-8"))
                for step, text in self._texts(f"spikes/{kind}/json").items()]

    def pages(self):
        return {step: text.encode("utf-8") for step, text in self._texts(f"{HTML_KEY}/html").items()}

    def images(self):
        if IMAGE_KEY not in self.tags.get("images", []):
            return {}
        return {ev.step: ev.encoded_image_string for ev in self.acc.Images(IMAGE_KEY)}


def _is_logdir(path: Path) -> bool:
    return path.is_dir() and any(p.name.startswith(EVENTS) for p in path.iterdir() if p.is_file())


class TensorBoardBackend(Backend):
    name = "tensorboard"
    title = "TensorBoard"
    rank = 2

    def open(self, cfg, place, run_name, on_open):
        from ..async_writer import AsyncTracker

        if place.kept is not None:
            logdir = place.kept / "tensorboard"
        else:  # the scratch run dir goes with the run: the log dir is the run's, it stays
            logdir = Path.cwd() / "tensorboard" / f"{datetime.now():%Y-%m-%d_%H-%M-%S_%f}_{run_name or 'run'}"
        run_dir = place.path
        spec = {"logdir": str(logdir), "run_name": run_name}
        return AsyncTracker.from_config(cfg, self.name, lambda: TensorBoardTracker(**spec, run_dir=run_dir),
                                        run_dir, spec, owner=place.owner, on_open=on_open)

    def from_lightning(self, logger: Any) -> Any:
        return getattr(logger, "log_dir", None) if type(logger).__name__ == "TensorBoardLogger" else None

    def join(self, found, step_key, cfg, run_dir, owner, on_open):
        from ..async_writer import AsyncTracker

        self.require()
        spec = {"logdir": str(found), "joined": True}
        return AsyncTracker.from_config(cfg, self.name, lambda: TensorBoardTracker(found, run_dir, attached=True),
                                        run_dir, spec, owner=owner, on_open=on_open)

    def resume(self, run_dir, run, spec, tracking_uri):
        where = run or spec
        return TensorBoardTracker(where["logdir"], run_dir, where.get("run_name"))

    def is_run_folder(self, path):
        return _is_logdir(path)

    def run_id(self, run_dir, where):
        if where and where.get("logdir"):
            return f"tensorboard:{Path(where['logdir']).resolve()}"
        return f"tensorboard:{run_dir.resolve()}" if _is_logdir(run_dir) else None

    def report_files(self, run_dir, where, tracking_uri):
        logdir = Path(where["logdir"]) if where and where.get("logdir") else run_dir
        if not _is_logdir(logdir):
            return None
        self.require()
        reader = EventFiles(logdir)
        if not reader.has_spikes():
            return None
        title = (where or {}).get("run_name") or logdir.name
        return RunFiles(logdir, title, None, run_id=self.run_id(run_dir, where) or "", reader=reader)

    def where(self, view, page):
        return [f"TensorBoard log dir {view.get('logdir')}"] if view.get("logdir") else []

    def commands(self, view):
        if not view.get("logdir"):
            return []
        return [f"  tensorboard --logdir {view['logdir']}    # then open http://localhost:6006 (Text tab: spikes/)"]
