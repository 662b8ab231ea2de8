"""The held-out zoo's split: every (family, data source, scenario kind) is 'dev' or 'heldout', fixed
before anyone tunes the detector or the localizer (issue 37, item 1).

Why a split. The spike zoo (``spike_zoo.py``: families ``demo``, ``hf``, ``trl``) is where the
defaults were chosen, and on it they look perfect (117/117 harmful steps, 0.33 false events per
1000 clean steps). Tried on data and failures nobody tuned for, the diagnosis is often wrong. A
number a tuned default reaches on the data it was tuned on says little; so the lead tunes on
``dev`` only, and the ``heldout`` half is reported beside it, untouched by the tuning.

How the split is drawn. A triple is held out when its data source OR its scenario kind is held
out (``half``): nothing tuned on ``dev`` ever sees a held-out source or kind.

- Sources. ``dev`` is the text the current zoo trains on: Python's pydoc topics (English reST prose,
  ``gradloc_track.demo.data.load_corpus``), and since stop 59 C headers, Debian changelogs and the three
  packed together (pydoc's clean runs gave almost no false event to choose on: ``sources.py``). Held out are
  the sources the issue names as unseen: Python source code (the stdlib ``.py`` files of the venv's Python),
  Debian licence and copyright text (``/usr/share/common-licenses``, ``/usr/share/doc/*/copyright``: names
  in Arabic, Hebrew and CJK scripts, file lists, runs of ``#`` and ``=``, indented code), tables,
  chat-formatted SFT and packed long documents of 256-4096 tokens in 1024-token rows. (``zoo/sources.py``
  builds them, offline.)
- Kinds. Each finding of the issue has a sibling in each half, so the lead can tune on one and
  see whether the fix carries to the other: many culprits (two different random samples: dev;
  three identical junk samples, a base64 blob inside a sample, a 400-token junk document in a
  packed row: heldout), the token (one or, since stop 60, four culprit terms among 1024: dev; eight:
  heldout), aftermath of a schedule change (lr x50 for one step: dev; a cosine restart to the peak that stays there:
  heldout), numeric causes (one sample overflowing fp16 under autocast: dev; one weight's exponent
  bit flipped: heldout), a loss that falls too far (targets equal to inputs on 3 of 8 rows:
  heldout only: the issue's "invisible" finding, nothing of its kind to tune on), RL off-policy (the
  TRL example's stale log-prob of a whole completion: dev; log-prob mismatch on a few tokens:
  heldout) and RL data (a reward outlier: dev, as in the spike zoo; garbage completions: heldout).
- Families. Both halves hold every front door the issue names: the nanoGPT-style loop with
  ``gradloc_track.watch(model, opt)`` (``loop``; ``loop64`` is the same loop at B=64, T=16 for the
  token scenarios), HF ``Trainer`` with ``GradLocCallback()`` on random-init Llama, GPT-2 (its
  default dropout on) and Qwen2, packed rows (``packed``, Llama in Trainer), and TRL's GRPO
  (``grpo``, the spike zoo's TRL family). The spike zoo's own families are ``dev`` whole.

``RUNS`` is the one list of what the held-out zoo runs: (family, source, kind) with its half.
Adding a run later is fine; moving one between halves after tuning began is not.
"""
from __future__ import annotations

from dataclasses import dataclass

DEV, HELDOUT = "dev", "heldout"

# data source -> half
SOURCES = {
    "pydoc": DEV,  # pydoc topics, reST prose: the spike zoo's corpus
    "python": HELDOUT,  # the stdlib .py files: code, indentation, comments, docstrings
    "licences": HELDOUT,  # Debian licence and copyright text: non-Latin names, file lists, rules of '#'/'='
    "chat": HELDOUT,  # chat-formatted SFT (prompt masked), answers from licence text and docstrings
    "tables": HELDOUT,  # text tables: Unicode names, stdlib module index, services, aligned columns
    "long_docs": HELDOUT,  # packed long documents (256-4096 tokens) of the held-out sources
    # added at stop 59 (its clean runs gave the dev half no false event to choose on; sources.py):
    "c_headers": DEV,  # C headers under /usr/include: code
    "changelogs": DEV,  # Debian changelogs: names, versions, e-mail addresses
    "mixed_docs": DEV,  # pydoc, C headers and changelogs interleaved, packed (the dev twin of long_docs)
    "perl": DEV,  # stop 60: Perl modules, code with heavier-tailed norms than the C headers (sources.py)
}


@dataclass(frozen=True)
class Kind:
    half: str
    causes: tuple[str, ...]  # the causes that are right (the first is the one the issue asks for)
    level: str  # the culprit's level: token | span | sample | document | none (not a data culprit)
    aftermath: int = 0  # steps after each injection that belong to its incident (recovery window)
    note: str = ""


KINDS = {
    "clean": Kind(DEV, (), "none", note="no change: the clean twin (false events)"),
    "placebo": Kind(DEV, (), "none", note="other clean batches at the scenarios' steps (the harm's control)"),
    "two_random_samples": Kind(DEV, ("data",), "sample", note="two samples of 8 are different random bytes/tokens"),
    "one_token": Kind(DEV, ("data",), "token", note="one term among 1024 (B=64, T=16) carries a loss weight of 64 "
                      "and a junk target (a corrupted per-token weight column)"),
    "lr_x50": Kind(DEV, ("schedule",), "none", aftermath=20, note="the learning rate x50 for one step"),
    "fp16_sample": Kind(DEV, ("numeric", "precision"), "sample",
                        note="under fp16 autocast one sample (one byte repeated) overflows fp16, the rest fit"),
    "stale_logprob": Kind(DEV, ("off_policy",), "sample", note="TRL: one completion's old log-probs 6 nats stale "
                          "(the example's bug: importance ratio in the hundreds)"),
    "reward_outlier": Kind(DEV, ("data",), "sample", note="TRL: one completion's reward 100"),
    "converged": Kind(DEV, (), "none", note="TRL: a clean run of a converged policy (false events)"),
    "three_identical_junk": Kind(HELDOUT, ("data",), "sample", note="three samples of 8 are the same junk"),
    "base64_blob": Kind(HELDOUT, ("data",), "span", note="half a sample is a base64 blob of random bytes"),
    "packed_junk_doc": Kind(HELDOUT, ("data",), "document", note="a 400-token junk document in a packed row"),
    "eight_tokens": Kind(HELDOUT, ("data",), "token", note="8 terms among 1024, in 8 rows, as one_token"),
    # added at stop 60, after the held-out half lost eight_tokens steps: one_token's harm is inside the placebo
    # noise, so the dev half had no harmful token kind to weigh recall of a moderate norm jump on
    "four_tokens": Kind(DEV, ("data",), "token", note="4 terms among 1024, in 4 rows, as one_token"),
    "cosine_restart": Kind(HELDOUT, ("schedule",), "none", aftermath=10 ** 6,
                           note="the cosine schedule restarts at its peak lr and stays there"),
    "weight_bitflip": Kind(HELDOUT, ("numeric",), "none", aftermath=10 ** 6,
                           note="one weight's exponent bit flipped before the forward (0.012 -> ~4e36)"),
    "labels_leaked": Kind(HELDOUT, ("data",), "sample", note="targets equal to inputs on 3 of 8 rows"),
    "stale_tokens": Kind(HELDOUT, ("off_policy",), "token", note="TRL: 3 tokens of one completion with old "
                         "log-probs 6 nats stale (sampler/trainer log-prob mismatch)"),
    "garbage_completion": Kind(HELDOUT, ("data",), "sample", note="TRL: the sampler returns random tokens for one "
                               "completion"),
}
DATA_LEVELS = ("token", "span", "sample", "document")

# family -> its front door, in words
FAMILIES = {
    "loop": "nanoGPT-style byte-level GPT, own loop, gradloc_track.watch(model, opt)",
    "loop64": "the same loop at B=64, T=16 (token culprits; handle.set_loss_fn for the weighted terms)",
    "llama": "random-init Llama in transformers.Trainer with GradLocCallback(), 2k BPE",
    "gpt2": "random-init GPT-2 (default dropout 0.1) in transformers.Trainer with GradLocCallback(), 2k BPE",
    "qwen2": "random-init Qwen2 in transformers.Trainer with GradLocCallback(), 2k BPE",
    "packed": "random-init Llama in transformers.Trainer with GradLocCallback(), 1024-token packed rows",
    "grpo": "TRL GRPOTrainer on a tiny GPT-2 with GradLocCallback (the spike zoo's TRL family)",
}
OLD_FAMILIES = ("demo", "hf", "trl")  # spike_zoo.py's: dev whole (the defaults were tuned on them)

_HF = ("llama", "gpt2", "qwen2")
_DEV_KINDS = {"loop": ("two_random_samples", "lr_x50", "fp16_sample"), "loop64": ("one_token", "four_tokens"),
              **{f: ("two_random_samples", "lr_x50") for f in _HF}, "packed": ("two_random_samples", "lr_x50"),
              "grpo": ("converged", "stale_logprob", "reward_outlier")}
_HELDOUT_KINDS = ("three_identical_junk", "base64_blob", "cosine_restart", "weight_bitflip", "labels_leaked")
_HELDOUT = {("loop", "python"): _HELDOUT_KINDS, ("loop", "tables"): ("three_identical_junk", "base64_blob"),
            ("loop64", "python"): ("eight_tokens",),
            **{(f, "licences"): _HELDOUT_KINDS for f in _HF}, ("qwen2", "chat"): ("three_identical_junk",),
            ("packed", "long_docs"): ("packed_junk_doc", "cosine_restart"),
            ("grpo", "licences"): ("stale_tokens", "garbage_completion")}


# the dev sources added at stop 59, each with a data injection beside its clean run (recall on the new text)
_DEV_MORE = {("loop", "c_headers"): ("two_random_samples",), ("qwen2", "changelogs"): ("two_random_samples",),
             ("packed", "mixed_docs"): ("two_random_samples",),
             ("loop64", "c_headers"): ("one_token", "four_tokens"),  # stop 60: a harmful token kind on code
             ("loop", "perl"): ("two_random_samples",), ("loop64", "perl"): ("four_tokens",)}  # stop 60


def half(family: str, source: str, kind: str) -> str:
    """'heldout' when the source or the kind is held out (a spike-zoo family is dev whole), else 'dev'."""
    if family not in FAMILIES and family not in OLD_FAMILIES:
        raise ValueError(f"family={family!r} is not in the split: use one of {', '.join([*FAMILIES, *OLD_FAMILIES])}")
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not in the split: use one of {', '.join(SOURCES)}")
    kind = "placebo" if kind.startswith("placebo") else kind
    if kind not in KINDS:
        if family in OLD_FAMILIES:  # the spike zoo's own scenarios (garbled_tokens, ...)
            return DEV
        raise ValueError(f"kind={kind!r} is not in the split: use one of {', '.join(KINDS)}")
    if family in OLD_FAMILIES:
        return DEV
    return HELDOUT if HELDOUT in (SOURCES[source], KINDS[kind].half) else DEV


def known_cause(kind: str) -> str:
    """A run's ``RunRecord.cause``: the kind's first right cause; "placebo" / "none" for the controls."""
    if kind.startswith("placebo"):
        return "placebo"
    return (KINDS[kind].causes or ("none",))[0]


def _runs() -> list[tuple[str, str, str]]:
    out = []
    for fam, kinds in _DEV_KINDS.items():
        out += [(fam, "pydoc", k) for k in ("clean", *kinds)]
    for (fam, src), kinds in {**_DEV_MORE, **_HELDOUT}.items():
        out += [(fam, src, k) for k in ("clean", *kinds)]
    return out


RUNS = tuple(_runs())  # (family, source, kind): what heldout_zoo.py runs, placebos added per family


def runs(half_name: str | None = None, families: list[str] | None = None) -> list[tuple[str, str, str]]:
    """The split's runs of one half (or both), of the families given (or all)."""
    return [r for r in RUNS if (half_name is None or half(*r) == half_name) and (families is None or r[0] in families)]
