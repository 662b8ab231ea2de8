"""A culprit in words: who it is (a sample, an RL completion by group, index and reward, a packed
document, a micro-batch), its level, its text (its loss-bearing tokens: an RL completion, not its
padded prompt) and its share of the step's squared gradient norm, from a ``SpikeView`` of one spike.
Pure functions of the view: what the block and the summary print."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..localizer.culprit_view import CulpritView
from ..text import quoted
from ..trackers.spike_story import SHARE_OF  # one phrase for the console and the run page
from ..units import micro_batch_label

MAX_LINES = 6  # culprit lines per block; the rest are counted
# the RL columns a culprit line shows when the culprit table has them (TRL's GRPO, verl, examples/rl_grpo.py)
RL_COLUMNS = (("ratio", "ratio"), ("logprob", "log-prob"), ("old_logprob", "old log-prob"))


def _pct(share: float | None) -> str:
    """A share as a percentage; a share below 0 (a row pulling against the spike) reads 0%."""
    return "?" if share is None else f"{max(share, 0.0):.0%}"


@dataclass
class SpikeView:
    """What one spike block shows: ``SpikeView.of(stats)`` from a ``GradStats``. ``context``: the
    ``SpikeContext`` the culprits index (rank 0's gathered view under torch.distributed);
    ``not_localized``: why there is no ``result``; ``surgery``: a ``SurgeryResult``."""

    step: int
    events: Sequence[Any]
    result: Any = None
    context: Any = None
    not_localized: str | None = None
    surgery: Any = None
    aftermath_of: int | None = None  # the step whose incident this spike is the aftermath of (its cause says)

    @classmethod
    def of(cls, stats: Any, not_localized: str | None = None) -> "SpikeView":
        """``not_localized``: a better reason than the monitor's, when the caller knows one (a trainer
        whose loss is not rebuilt)."""
        if isinstance(stats, SpikeView):
            return stats
        result, ctx = stats.locate_view or (stats.locate, None)
        why = not_localized or stats.not_localized if result is None else None
        cause = getattr(getattr(stats, "outcome", None), "cause", None)
        return cls(stats.step, list(stats.events), result, ctx, why, stats.surgery,
                   getattr(cause, "aftermath_of", None))

    def __post_init__(self) -> None:
        self.culprit_view = CulpritView(self.result, self.context)  # how the table and the cause name them too

    def who(self, mb: int | None, sample: int, document: int | None = None) -> tuple[str, str]:
        """(label, unit) of a sample: ``CulpritView.who``."""
        return self.culprit_view.who(mb, sample, document)

    def rl_values(self, mb: int | None, sample: int, positions: Sequence[int]) -> str:
        """``ratio 392, log-prob -0.21, old log-prob -6.21``: the RL columns the culprit table has
        (``extra_columns`` ``ratio``/``logprob``/``old_logprob``), a token's value or the mean over a
        run's or unit's loss terms (as the table's rows); "" without them."""
        parts = []
        for name, label in RL_COLUMNS:
            value = self.culprit_view.mean_of(name, mb, sample, positions)
            if value is not None:
                parts.append(f"{label} {value:.3g}")
        return ", ".join(parts)


QUOTE = 40  # characters a culprit's text gets on its line
NONFINITE = "  (its gradient is non-finite)"


def _unit_line(view: SpikeView, c: Any) -> str:
    """A span, a sample (completion, document) or a micro-batch: who, what, its text, its share."""
    share = f"  ({_pct(c.share)} {SHARE_OF})" if c.share is not None else ""
    share = NONFINITE if c.nonfinite else share
    if c.level == "micro_batch":
        return f"{micro_batch_label(c.micro_batch)}: the whole micro-batch (no sample or token in it stands out){share}"
    label, unit = view.who(c.micro_batch, c.batch, c.document)
    what = f"span {c.start}-{c.end - 1}" if c.level == "span" else f"the whole {unit}"
    terms = view.culprit_view.terms(c)
    rl = view.rl_values(c.micro_batch, c.batch, terms)
    text = _whole_characters(view, c, terms)
    if len(text) > QUOTE:  # longer than its line: from its hottest part, when that is out of view
        shown = _hot_terms(view, c, terms)
        if shown is not None:
            text = "\u2026" + view.culprit_view.text_at(c.micro_batch, c.batch, shown)
    return f"{label}, {what}: {quoted(text, QUOTE)}{share}" + (f"  {rl}" if rl else "")


BROKEN = "\ufffd"  # what a byte-level tokenizer decodes a character's later bytes to, without its first


def _whole_characters(view: SpikeView, c: Any, terms: list[int]) -> str:
    """The unit's text, from the first byte of its first character: a document's first token scores no term, so
    a byte-level BPE that split a character there left its quote starting with U+FFFD (held-out tester, stop 57:
    ``'\ufffd€™Ã©…'``, a string the user's data does not hold). Up to 3 tokens before the unit are decoded with
    it when they end in a character's first bytes (alone they decode to U+FFFD too) and that gives whole
    characters; a real U+FFFD in the text (bytes EF BF BD) stays as it is (review, stop 57)."""
    cv = view.culprit_view
    text = cv.text_at(c.micro_batch, c.batch, terms)
    for back in range(1, 4):
        if not text.startswith(BROKEN) or not terms or terms[0] - back < 0:
            return text
        lead = list(range(terms[0] - back, terms[0]))
        whole = cv.text_at(c.micro_batch, c.batch, lead + terms)
        if cv.text_at(c.micro_batch, c.batch, lead).endswith(BROKEN) and not whole.startswith(BROKEN):
            return whole
    return text


HOT_LEAD = 3  # terms shown before a long unit's hottest one


def _hot_terms(view: SpikeView, c: Any, terms: list[int]) -> list[int] | None:
    """The terms of a unit too long for its line to show, from just before the term the ghost pass rated
    highest, when that term sits past the first half of the line's characters (so a sample whose bad text
    follows a clean start shows that text; held-out tester round 5); None: its start shows it, or no map."""
    result = view.result
    maps = getattr(result, "ghost_maps", None)
    gmap = maps[c.micro_batch] if maps and c.micro_batch is not None and c.micro_batch < len(maps) \
        else getattr(result, "ghost_map", None)
    try:
        row = gmap[c.batch]
        if len(terms) <= HOT_LEAD or row.shape[0] <= max(terms):  # a map of other rows (a gathered view)
            return None
        i = max(range(len(terms)), key=lambda k: float(row[terms[k]]))  # host reads: a spike block's, per unit
    except Exception:  # no map (not a ghost search): its start
        return None
    if i - HOT_LEAD <= 0 or len(view.culprit_view.text_at(c.micro_batch, c.batch, terms[:i])) < QUOTE // 2:
        return None  # its hottest part is in view from the start
    return terms[i - HOT_LEAD:]


def _token_runs(view: SpikeView) -> list[tuple[float, str]]:
    """Culprit tokens grouped into contiguous runs per sample: ``sample 3, tokens 40-42: 'â€™'``."""
    by_sample: dict[tuple, list] = {}
    for c in sorted(view.result.tokens, key=lambda c: (c.micro_batch or 0, c.batch, c.position)):
        by_sample.setdefault((c.micro_batch, c.batch), []).append(c)
    out = []
    for (mb, sample), cs in by_sample.items():
        runs: list[list] = [[cs[0]]]
        for c in cs[1:]:
            (runs[-1].append(c) if c.position == runs[-1][-1].position + 1 else runs.append([c]))
        for run in runs:
            first, last = run[0].position, run[-1].position
            where = f"tokens {first}-{last}" if len(run) > 1 else f"token {first}"
            share = sum(c.share or 0.0 for c in run)
            label, _ = view.who(mb, sample, view.culprit_view.document_at(mb, sample, first))
            # decoded together: a character split over byte tokens comes out whole, as the table's span text
            text = view.culprit_view.text_at(mb, sample, [c.position for c in run])
            tail = NONFINITE if any(c.nonfinite for c in run) else f"  ({_pct(share)} {SHARE_OF})"
            rl = view.rl_values(mb, sample, [c.position for c in run])
            out.append((share, f"{label}, {where}: {quoted(text, QUOTE)}{tail}" + (f"  {rl}" if rl else "")))
    return out


def culprit_lines(view: SpikeView) -> list[str]:
    """Every culprit row of a localized spike, largest share first (token runs merged)."""
    if view.result is None:
        return []
    rows = [(c.share or 0.0, _unit_line(view, c)) for c in view.result.culprits if c.level != "token"]
    rows += _token_runs(view)
    return [line for _, line in sorted(rows, key=lambda r: -r[0])]


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


def culprit_count(view: SpikeView) -> str:
    """``1 sample (3 tokens)``, ``1 completion (whole)``, ``2 documents (1 whole, 5 tokens)``: the
    units the rows name and the rows by level, counted as the block lists them."""
    found = view.result.culprits if view.result is not None else []
    units, levels, noun = set(), {}, "sample"
    for c in found:
        levels[c.level] = levels.get(c.level, 0) + 1
        if c.level == "micro_batch":
            continue
        doc = view.culprit_view.document(c)
        units.add((c.micro_batch, c.batch, doc))
        noun = view.who(c.micro_batch, c.batch, doc)[1]
    rows = [f"{levels['sample']} whole" if "sample" in levels else None,
            _plural(levels["span"], "span") if "span" in levels else None,
            _plural(levels["token"], "token") if "token" in levels else None]
    rows = [r for r in rows if r]
    whole_only = rows == [f"{len(units)} whole"]  # "1 completion", not "1 completion (1 whole)"
    out = [_plural(len(units), noun) + ("" if whole_only else f" ({', '.join(rows)})")] if units else []
    if "micro_batch" in levels:
        out.append(_plural(levels["micro_batch"], "micro-batch", "micro-batches"))
    return ", ".join(out)
