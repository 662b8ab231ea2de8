"""The held-out zoo's data sources, built offline from files on this machine (``split.SOURCES``).

Each source is a list of documents (strings); every tenth document is kept out of training for the
held-out loss (``documents(source, "eval")``), the rest train. Nothing downloads:

- ``pydoc``: Python's pydoc topics (the spike zoo's corpus, ``gradloc_track.demo.data.load_corpus``);
- ``python``: the ``.py`` files of the venv's standard library (top level, sorted by name);
- ``licences``: ``/usr/share/common-licenses/*`` and ``/usr/share/doc/*/copyright``, identical files
  once, each cut at ``MAX_DOC_CHARS`` (a few Boost files are 2 MB);
- ``tables``: text tables made from the machine: Unicode names of Latin, Greek, Cyrillic, Hebrew,
  Arabic, CJK and box-drawing characters, the stdlib module index (lines, first docstring line),
  ``/etc/services`` and ``/etc/protocols``, an ASCII code chart;
- ``chat``: chat-formatted SFT conversations (ChatML ``<|im_start|>`` / ``<|im_end|>``): a question
  about a stdlib function or a Debian package, answered by its docstring or its copyright header;
- ``long_docs``: the licence, Python and table documents, for packing (``packed.py`` keeps those of
  256-4096 tokens).

Added to the dev half at stop 59 (``split.SOURCES``), because its clean runs were too easy to choose the
detector's thresholds on: 1 false event in 6920 steps (seeds 0-1), against 10 in 4660 on the held-out half
(seed 0). Sources of the same shapes as the held-out ones, from other files (none is read by a held-out source):

- ``c_headers``: C headers under ``/usr/include`` (code: macros, declarations, licence comments), in a
  fixed shuffled order so one library does not fill the cap;
- ``changelogs``: Debian changelogs (``/usr/share/doc/*/changelog.Debian.gz``: names, versions, e-mail
  addresses, bug numbers), the same shuffle;
- ``mixed_docs``: the pydoc, C header and changelog documents interleaved, for packing (the dev twin of
  ``long_docs``).
- ``perl`` (stop 60): Perl modules (``/usr/share/perl``, ``/usr/lib/*/perl*``: code and its POD), the same
  shuffle: code with heavier-tailed gradient norms than the C headers, as the held-out Python source has.

``ByteBpe``: a 2048-token byte-level BPE trained with ``tokenizers`` on a source's training
documents (a few seconds; cached by content hash), with ``<pad>`` and the two ChatML markers as
special tokens: byte-level, so no script is ``<unk>``.
"""
from __future__ import annotations

import ast
import functools
import glob
import hashlib
import os
import sysconfig
import unicodedata
from pathlib import Path

MAX_DOC_CHARS = 60_000
MAX_SOURCE_CHARS = 3_000_000
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradloc-track" / "heldout-zoo"
PAD, IM_START, IM_END = "<pad>", "<|im_start|>", "<|im_end|>"
TABLE_BLOCKS = {"Latin-1": (0xA0, 0x100), "Greek": (0x391, 0x3CA), "Cyrillic": (0x410, 0x450),
                "Hebrew": (0x5D0, 0x5EB), "Arabic": (0x621, 0x64B), "CJK": (0x4E00, 0x4E80),
                "Box drawing": (0x2500, 0x2580)}


def _capped(docs: list[str]) -> list[str]:
    out, total = [], 0
    for d in docs:
        d = d[:MAX_DOC_CHARS]
        if d.strip() and total < MAX_SOURCE_CHARS:
            out.append(d)
            total += len(d)
    return out


def _pydoc() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _python() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in _stdlib_files()]


def _licences() -> list[str]:
    seen, out = set(), []
    for p in sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright")):
        try:
            raw = Path(p).read_bytes()
        except OSError:
            continue
        digest = hashlib.sha1(raw).hexdigest()
        if digest not in seen:
            seen.add(digest)
            out.append(raw.decode("utf-8", errors="replace"))
    return out


def _shuffled(paths: list[str]) -> list[str]:
    """``paths`` sorted, then in a fixed random order (seed 0): the cap takes a spread of libraries."""
    import random

    out = sorted(paths)
    random.Random(0).shuffle(out)
    return out


def _texts(paths: list[str]) -> list[str]:
    """The files' texts in the fixed shuffled order; one that cannot be read (a dangling link) is skipped."""
    out = []
    for p in _shuffled(paths):
        try:
            out.append(Path(p).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return out


def _c_headers() -> list[str]:
    return _texts(glob.glob("/usr/include/**/*.h", recursive=True))


def _perl() -> list[str]:
    found = glob.glob("/usr/share/perl/**/*.pm", recursive=True) + glob.glob("/usr/lib/*/perl*/**/*.pm", recursive=True)
    return _texts(sorted({os.path.realpath(p) for p in found}))  # once each: /usr/share/perl/5.36 -> 5.36.0 (review)


def _changelogs() -> list[str]:
    import gzip

    out = []
    for p in _shuffled(glob.glob("/usr/share/doc/*/changelog.Debian.gz")):
        try:
            out.append(gzip.decompress(Path(p).read_bytes()).decode("utf-8", errors="replace"))
        except (OSError, EOFError):
            continue
    return out


def _unicode_table(name: str, lo: int, hi: int) -> str:
    rows = [f"{name} characters", "", "| code | char | name | category |", "|------|------|------|----------|"]
    for cp in range(lo, hi):
        ch = chr(cp)
        rows.append(f"| U+{cp:04X} | {ch} | {unicodedata.name(ch, '<unnamed>')} | {unicodedata.category(ch)} |")
    return "\n".join(rows) + "\n"


def _module_index() -> str:
    rows = [f"{'module':<24} {'lines':>6}  summary", "=" * 24 + " " + "=" * 6 + "  " + "=" * 40]
    for p in _stdlib_files():
        text = p.read_text(encoding="utf-8", errors="replace")
        try:
            doc = (ast.get_docstring(ast.parse(text)) or "").strip().splitlines()
        except SyntaxError:
            doc = []
        rows.append(f"{p.stem:<24} {text.count(chr(10)):>6}  {doc[0] if doc else ''}")
    return "\n".join(rows) + "\n"


def _ascii_chart() -> str:
    rows = ["Dec  Hex  Oct  Char", "---  ---  ---  ----"]
    rows += [f"{i:>3}  {i:>3X}  {i:>3o}  {chr(i) if 32 <= i < 127 else unicodedata.name(chr(i), 'CTRL')[:4]}"
             for i in range(128)]
    return "\n".join(rows) + "\n"


def _tables() -> list[str]:
    docs = [_unicode_table(n, lo, hi) for n, (lo, hi) in TABLE_BLOCKS.items()]
    docs += [_module_index(), _ascii_chart()]
    for p in ("/etc/services", "/etc/protocols"):
        if os.path.exists(p):
            docs.append(Path(p).read_text(encoding="utf-8", errors="replace"))
    return docs


def _functions() -> list[tuple[str, str]]:
    """(module.function, its docstring) for documented top-level functions of the stdlib."""
    out = []
    for p in _stdlib_files():
        try:
            tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
            if doc and len(doc) > 40 and not node.name.startswith("_"):
                out.append((f"{p.stem}.{node.name}", doc))
    return out


def chat_turn(question: str, answer: str) -> tuple[str, str]:
    """(the prompt part, the answer part) of one ChatML conversation: the loss is on the answer only."""
    prompt = f"{IM_START}system\nYou answer questions about Debian and Python.{IM_END}\n" \
             f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"
    return prompt, f"{answer.strip()[:1500]}{IM_END}\n"


def _chat() -> list[str]:
    turns = [chat_turn(f"What does `{name}` do?", doc) for name, doc in _functions()]
    for p in sorted(glob.glob("/usr/share/doc/*/copyright")):
        head = Path(p).read_text(encoding="utf-8", errors="replace")[:1200]
        turns.append(chat_turn(f"Who holds the copyright of the Debian package {Path(p).parent.name}?", head))
    return ["".join(t) for t in turns]


BUILDERS = {"pydoc": _pydoc, "python": _python, "licences": _licences, "tables": _tables, "chat": _chat,
            "c_headers": _c_headers, "changelogs": _changelogs, "perl": _perl}


@functools.lru_cache(maxsize=None)
def _all(source: str) -> tuple[str, ...]:
    if source == "long_docs":
        return tuple(d for pair in zip(_all("licences"), _all("python")) for d in pair) + _all("tables")
    if source == "mixed_docs":  # the dev twin of long_docs: three sources interleaved
        return tuple(d for trio in zip(_all("c_headers"), _all("changelogs"), _all("pydoc")) for d in trio)
    if source not in BUILDERS:
        known = ", ".join([*BUILDERS, "long_docs", "mixed_docs"])
        raise ValueError(f"source={source!r} is unknown: use one of {known}")
    docs = BUILDERS[source]()
    return tuple(docs if source == "pydoc" else _capped(docs))


def documents(source: str, part: str = "train") -> list[str]:
    """The source's training documents (``part="train"``) or held-out ones (``"eval"``: every tenth)."""
    docs = _all(source)
    keep = (lambda i: i % 10 == 9) if part == "eval" else (lambda i: i % 10 != 9)
    return [d for i, d in enumerate(docs) if keep(i)]


def text(source: str, part: str = "train") -> str:
    """The documents joined by blank lines (a byte-level model's stream)."""
    return "\n\n".join(documents(source, part))


class ByteBpe:
    """A byte-level BPE (``tokenizers``) with the methods the library's console and TRL use."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.pad_id = tok.token_to_id(PAD)

    @classmethod
    def train_or_load(cls, source: str, vocab_size: int = 2048) -> "ByteBpe":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        docs = documents(source)
        digest = hashlib.sha256("\0".join(docs).encode("utf-8")).hexdigest()[:12]
        path = CACHE / f"bpe-{source}-{vocab_size}-{digest}.json"
        if path.exists():
            return cls(Tokenizer.from_file(str(path)))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, IM_START, IM_END],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(docs, trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.decode([int(i)]) for i in ids]

    def to_transformers(self):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self._tok, pad_token=PAD, eos_token=PAD)
