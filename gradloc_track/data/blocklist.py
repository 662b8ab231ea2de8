"""A blocklist: the samples a culprit ledger blamed, as a small versioned JSON file.

Written by ``gradloc-track culprits --export-blocklist FILE``; read by ``load_blocklist`` and the
filters in ``gradloc_track.data``. Each entry names a sample by its fingerprint (``sample_id``,
``artifacts.identity``: the same text gives the same id in any run and any dataset order) and, when
the runs logged one, by its dataset index (valid only for the dataset those runs read)::

    {"format": "gradloc-track-blocklist", "version": 1, "index_column": "dataset_index", "samples": [
    {"sample_id": "3f2a...", "index": 401, "blamed": 2, "runs": [...], "max_share": 0.97, "text": "...", ...},
    ...
    ]}

One entry per line, ``sample_id`` and ``index`` first: still one JSON document, and a reader that
needs only the ids (``load_blocklist``) takes them from each line's start without parsing the rest,
so a 10^6-entry file loads in seconds and a few hundred MB. A file in any other layout (older
exports, hand edits) is parsed whole, with the same checks. An entry's ``sample_id`` is 16 hex
digits, exactly (``fullmatch``: a trailing newline is an error, not a silent non-match); its
``index`` is absent, an integer, a string, or a flat list of them. Indices are compared by value: a
string written as a plain decimal integer ("401", "-3"; not "0401" nor " 401") is that integer, since a
hand edit or a CSV round trip turns one into the other. The file is rewritten atomically
(``trackers.files``): a kill mid-export leaves the old blocklist.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from ..artifacts.identity import FINGERPRINT
from ..trackers.files import atomic_file

FORMAT = "gradloc-track-blocklist"
VERSION = 1
FIX = "pass a file written by 'gradloc-track culprits ... --export-blocklist FILE'"
# an entry line as write_blocklist writes it, up to its index (the rest of the line is not needed)
_ENTRY = re.compile(rb'\n\{"sample_id":"([0-9a-f]{16})","index":'
                    rb'(null|-?[0-9]+|"(?:[^"\\\n]|\\.)*"|\[[^\[\]{}\n]*\])[,}]')
_CHUNK = 1 << 22  # bytes read at a time by the fast reader
_DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)")  # a string that is an integer written plainly


class BlocklistError(ValueError):
    """A blocklist file that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Blocklist:
    """Fingerprints (always) and dataset indices (when known) of samples to leave out.

    ``count`` entries; ``read_entries()`` gives them whole (text, runs, metadata), read again from
    ``path`` on demand: a large blocklist is never held in memory whole."""

    fingerprints: frozenset[str] = frozenset()
    indices: frozenset[Any] = frozenset()
    index_column: str = "dataset_index"
    count: int = 0
    path: Path | None = None

    def blocks(self, fingerprint: str | None = None, index: Any = None) -> bool:
        """Whether a sample with this fingerprint (or, if given, this dataset index, by value) is listed."""
        return (fingerprint is not None and fingerprint in self.fingerprints) or \
            (index is not None and index_value(index) in self.indices)

    def read_entries(self) -> list[dict[str, Any]]:
        """Every entry of the file, whole."""
        return [] if self.path is None else _parse_whole(self.path, "blocklist")["samples"]

    def __len__(self) -> int:
        return self.count or len(self.fingerprints)


def index_value(index: Any) -> Any:
    """A dataset index as the value it stands for: "401" is 401 (the record's ``401`` matches it)."""
    if isinstance(index, str) and _DECIMAL.fullmatch(index):
        return int(index)
    return index


def check_index(index: Any, where: str) -> list[Any]:
    """An entry's ``index`` as a list of dataset indices; ``BlocklistError`` naming ``where`` otherwise."""
    if index is None:
        return []
    values = index if isinstance(index, list) else [index]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise BlocklistError(f"{where}.index={index!r} is not a dataset index: use an integer, a string, or a "
                                 "flat list of them (or leave it out)")
    return [index_value(v) for v in values]


def check_sample_id(sample_id: Any, where: str) -> str:
    if not isinstance(sample_id, str) or not FINGERPRINT.fullmatch(sample_id):
        raise BlocklistError(f"{where}.sample_id={sample_id!r} is not a 16-hex fingerprint (16 characters 0-9a-f, "
                             "nothing before or after)")
    return sample_id


def _line(entry: Mapping[str, Any], i: int) -> str:
    where = f"samples[{i}]"
    sid = check_sample_id(entry.get("sample_id"), where)
    check_index(entry.get("index"), where)
    rest = {k: v for k, v in entry.items() if k not in ("sample_id", "index")}
    return json.dumps({"sample_id": sid, "index": entry.get("index"), **rest}, separators=(",", ":"), default=str)


def write_blocklist(path: str | Path, samples: Iterable[Mapping[str, Any]],
                    index_column: str = "dataset_index") -> Path:
    """Write ``samples`` (each with ``sample_id``; ``index`` etc. optional) as a blocklist file, one entry
    per line, atomically; ``BlocklistError`` naming the entry's field for a bad one (nothing written)."""
    path = Path(path)
    head = json.dumps({"format": FORMAT, "version": VERSION, "index_column": index_column}, separators=(",", ":"))
    with atomic_file(path) as f:
        f.write(head[:-1] + ',"samples":[')
        for i, entry in enumerate(samples):
            f.write(("\n" if i == 0 else ",\n") + _line(entry, i))
        f.write("\n]}\n")
    return path


def _header(doc: Any, where: str) -> str:
    """The index column of a blocklist document (its ``samples`` aside); ``BlocklistError`` if it is none."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BlocklistError(f"{where}: not a blocklist (no \"format\": \"{FORMAT}\"); {FIX}")
    if doc.get("version") != VERSION:
        raise BlocklistError(f"{where}: blocklist version {doc.get('version')!r} is not {VERSION}, the one this "
                             "gradloc-track reads; export it again with this version")
    if not isinstance(doc.get("samples"), list):
        raise BlocklistError(f"{where}: \"samples\" must be a list of objects; {FIX}")
    column = doc.get("index_column")
    if column is not None and not isinstance(column, str):
        raise BlocklistError(f"{where}: \"index_column\"={column!r} must be a column name (a string)")
    return column or "dataset_index"


def _too_deep(where: str) -> str:
    return f"{where}: nested too deeply to read (a blocklist is a list of flat entries); {FIX}"


def _parse_whole(path: Path, field_name: str) -> dict[str, Any]:
    """The whole document, every entry checked (any layout)."""
    where = f"{field_name}={str(path)!r}"
    try:
        doc = json.loads(path.read_bytes())
    except OSError as exc:
        raise BlocklistError(f"{where}: cannot read it ({exc.strerror or exc}); {FIX}") from None
    except RecursionError:
        raise BlocklistError(_too_deep(where)) from None
    except ValueError as exc:
        raise BlocklistError(f"{where}: not JSON ({exc}); {FIX}") from None
    _header(doc, where)
    for i, s in enumerate(doc["samples"]):
        if not isinstance(s, dict):
            raise BlocklistError(f"{where}: samples[{i}] is a {type(s).__name__}, not an object; {FIX}")
        check_sample_id(s.get("sample_id"), f"{where}: samples[{i}]")
        check_index(s.get("index"), f"{where}: samples[{i}]")
    return doc


def _chunks(f) -> Iterator[bytes]:
    """Whole lines, a few MB at a time."""
    rest = b""
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            if rest:
                yield rest
            return
        buf = rest + chunk
        cut = buf.rfind(b"\n") + 1
        if cut:
            yield buf[:cut]
        rest = buf[cut:]


def _read_fast(path: Path, where: str) -> Blocklist | None:
    """The ids and indices of a file in ``write_blocklist``'s layout, from each line's start; None if the
    file is in another layout (or any line is not as written), for ``_parse_whole`` to read."""
    ids: list[str] = []
    indices: list[Any] = []
    lines, last = 0, b""
    with open(path, "rb") as f:
        try:
            head = json.loads(f.readline().rstrip(b"\n") + b"]}")
        except (ValueError, RecursionError):  # another layout (or a hostile one): _parse_whole says which
            return None
        column = _header(head, where)
        for buf in _chunks(f):
            lines += buf.count(b"\n")
            last = buf.rstrip(b"\n").rsplit(b"\n", 1)[-1]
            found = _ENTRY.findall(b"\n" + buf)  # every entry starts a line
            for k, (_, raw) in enumerate(found, len(ids)):
                if raw[:1] == b"[":  # a sample the runs saw at several indices
                    indices += check_index(json.loads(raw), f"{where}: samples[{k}]")
                elif raw != b"null":
                    indices.append(index_value(json.loads(raw)) if raw[:1] == b'"' else int(raw))
            ids += [sid.decode("ascii") for sid, _ in found]
    if last != b"]}" or len(ids) != lines - 1:  # one line per entry, then the closing line
        return None
    return Blocklist(frozenset(ids), frozenset(indices), column, len(ids), path)


def load_blocklist(path: str | Path, field_name: str = "blocklist") -> Blocklist:
    """Read a blocklist file; ``BlocklistError`` naming ``field_name`` and the fix when it is not one."""
    path = Path(path)
    where = f"{field_name}={str(path)!r}"
    try:
        fast = _read_fast(path, where)
    except OSError as exc:
        raise BlocklistError(f"{where}: cannot read it ({exc.strerror or exc}); {FIX}") from None
    if fast is not None:
        return fast
    doc = _parse_whole(path, field_name)
    samples = doc["samples"]
    return Blocklist(frozenset(s["sample_id"] for s in samples),
                     frozenset(i for k, s in enumerate(samples) for i in check_index(s.get("index"), f"samples[{k}]")),
                     _header(doc, where), len(samples), path)
