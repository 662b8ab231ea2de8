"""Blocklist files (``data/blocklist.py``): what the fast reader takes from each line is what a whole
JSON parse gives; schema errors are ``BlocklistError`` naming the field; ids match exactly."""
from __future__ import annotations

import json

import pytest

from gradloc_track.data.blocklist import BlocklistError, load_blocklist, write_blocklist

FP = [f"{i:016x}" for i in range(1, 7)]
HOSTILE = 'say "]}", then {"sample_id":"ffffffffffffffff","index":9}\n\u202e'


def entries() -> list[dict]:
    return [{"sample_id": FP[0], "index": 3, "text": HOSTILE, "metadata": {"k": [1, {"a": "]"}]}},
            {"sample_id": FP[1], "index": [4, 5]}, {"sample_id": FP[2]}, {"sample_id": FP[3], "index": "doc-7"},
            {"sample_id": FP[4], "index": None, "runs": ["a]", "b"]}, {"sample_id": FP[5], "index": ["x]", 8]}]


def whole(path) -> tuple[set, set]:
    """The oracle: every entry parsed as JSON, indices flattened."""
    samples = json.loads(path.read_text())["samples"]
    idx = [s.get("index") for s in samples]
    return ({s["sample_id"] for s in samples},
            {i for v in idx if v is not None for i in (v if isinstance(v, list) else [v])})


def test_the_fast_reader_gives_what_a_whole_parse_gives(tmp_path):
    path = write_blocklist(tmp_path / "b.json", entries())
    fps, idx = whole(path)
    block = load_blocklist(path)
    assert (set(block.fingerprints), set(block.indices)) == (fps, idx) and len(block) == 6
    assert "ffffffffffffffff" not in block.fingerprints and 9 not in block.indices  # text is text
    assert block.read_entries()[0]["text"] == HOSTILE  # the file keeps every field exactly
    # the same document in another layout (an older export, a hand edit): read whole, same answer
    doc = json.loads(path.read_text())
    for i, text in enumerate((json.dumps(doc, indent=1), json.dumps(doc), json.dumps(doc, indent=1)[:-1] + " }")):
        other = tmp_path / f"o{i}.json"
        other.write_text(text)
        assert (set(load_blocklist(other).fingerprints), set(load_blocklist(other).indices)) == (fps, idx)


def test_a_large_blocklist_round_trips(tmp_path):
    n = 20_000
    path = write_blocklist(tmp_path / "big.json",
                           ({"sample_id": f"{i:016x}", "index": i, "text": "t"} for i in range(n)))
    block = load_blocklist(path)
    assert len(block) == n and block.blocks(fingerprint=f"{n - 1:016x}") and block.blocks(index=0)
    assert (set(block.fingerprints), set(block.indices)) == whole(path)


@pytest.mark.parametrize("entry, says", [
    ({"sample_id": FP[0] + "\n"}, "samples[1].sample_id='0000000000000001\\n' is not a 16-hex fingerprint"),
    ({"sample_id": 1234567890123456}, "samples[1].sample_id=1234567890123456 is not a 16-hex"),
    ({"sample_id": FP[0], "index": {"a": 1}}, "samples[1].index={'a': 1} is not a dataset index"),
    ({"sample_id": FP[0], "index": [[1, 2]]}, "samples[1].index=[[1, 2]] is not a dataset index"),
    ({"sample_id": FP[0], "index": True}, "samples[1].index=True is not a dataset index"),
    ({"sample_id": FP[0], "index": 1.5}, "samples[1].index=1.5 is not a dataset index")])
def test_schema_errors_name_the_field_when_written_and_when_read(tmp_path, entry, says):
    good = {"sample_id": FP[1], "index": 0}
    with pytest.raises(BlocklistError, match=None) as err:
        write_blocklist(tmp_path / "w.json", [good, entry])
    assert says in str(err.value) and not (tmp_path / "w.json").exists()  # nothing half-written
    path = tmp_path / "r.json"  # a hand-edited file, in the layout we write and in another one
    for text in (json.dumps({"format": "gradloc-track-blocklist", "version": 1, "samples": [good, entry]}),
                 '{"format":"gradloc-track-blocklist","version":1,"index_column":"i","samples":[\n'
                 + json.dumps(good, separators=(",", ":")) + ",\n" + json.dumps(entry, separators=(",", ":"))
                 + "\n]}\n"):
        path.write_text(text)
        with pytest.raises(BlocklistError) as err:
            load_blocklist(path, "data.blocklist")
        assert str(err.value).startswith(f"data.blocklist={str(path)!r}: ") and says in str(err.value)


def test_a_cut_file_is_read_whole_and_refused(tmp_path):
    path = write_blocklist(tmp_path / "b.json", entries())
    path.write_bytes(path.read_bytes()[:-6])  # the end of the last entry and the closing line gone
    with pytest.raises(BlocklistError, match="not JSON"):
        load_blocklist(path)


def test_rewriting_keeps_no_temp_file_and_follows_the_old_path(tmp_path):
    path = write_blocklist(tmp_path / "b.json", entries())
    write_blocklist(path, entries()[:2])
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"] and len(load_blocklist(path)) == 2


@pytest.mark.parametrize("where", ["head", "samples", "index", "metadata"])
def test_a_deeply_nested_file_is_a_blocklist_error(tmp_path, where):
    deep = "[" * 100_000 + "]" * 100_000
    head = '{"format":"gradloc-track-blocklist","version":1'
    entry = '{"sample_id":"0000000000000001","index":3'
    text = {"head": deep,
            "samples": head + ',"samples":[' + deep + "]}",
            "index": head + ',"samples":[' + entry[:-1] + deep + "}]}",
            "metadata": head + ',"index_column":"i","samples":[\n' + entry + ',"x":' + deep + "}\n]}\n"}[where]
    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(BlocklistError, match=r"nested too deeply.*--export-blocklist"):
        load_blocklist(path, "data.blocklist").read_entries()


@pytest.mark.parametrize("listed, asked", [("401", 401), (401, "401"), ("-3", -3), ([401, "7"], 7)])
def test_an_index_is_compared_by_value_not_by_type(tmp_path, listed, asked):
    path = write_blocklist(tmp_path / "b.json", [{"sample_id": FP[0], "index": listed}])
    for block in (load_blocklist(path), load_blocklist(_other_layout(path, tmp_path))):
        assert block.blocks(index=asked)
        assert not block.blocks(index=400) and not block.blocks(index="0401") and not block.blocks(index="doc")


def _other_layout(path, tmp_path):
    other = tmp_path / "indented.json"
    other.write_text(json.dumps(json.loads(path.read_text()), indent=1))
    return other
