"""``trackers/naming``: MLflow-safe keys (checked against MLflow's own two rules, written out here),
truncation that never exceeds its limit, and the artifact paths of the layout contract."""
from __future__ import annotations

import posixpath
import re

import pytest

from gradloc_track.trackers.naming import mlflow_key, step_path, table_part_path, truncate


def mlflow_accepts(name: str) -> bool:
    """MLflow 3's metric/param name check (mlflow/utils/validation.py): the characters, then a name
    that is its own normalised path (no empty, '.' or '..' segment, no leading '/')."""
    if not re.match(r"^[/\w.\- :]*$", name):
        return False
    norm = posixpath.normpath(name)
    return not (norm != name or norm == "." or norm.startswith("..") or norm.startswith("/"))


@pytest.mark.parametrize("key,expected", [
    ("grad_norm/h.0", "grad_norm/h.0"),
    ("grad_norm/tensor/h.0.attn.weight", "grad_norm/tensor/h.0.attn.weight"),
    ("train loss-2", "train loss-2"),
    ("clip/coef[0]", "clip/coef_0_"),
    ("a:b@c#d", "a_b_c_d"),
    ("données/é", "données/é"),  # unicode letters are alphanumerics to MLflow too
])
def test_bad_characters_become_underscores_and_the_rest_stays(key, expected):
    assert mlflow_key(key) == expected and mlflow_accepts(expected)


@pytest.mark.parametrize("key", ["eval//loss", "loss/", "/loss", "a/./b", "a/../b", ".", "..", "", "./x", "x/.."])
def test_a_key_mlflow_would_read_as_another_path_is_made_one_it_takes(key):
    """MLflow rejects the whole batch a key like ``eval//loss`` is in: the key is mended instead."""
    out = mlflow_key(key)
    assert mlflow_accepts(out), (key, out)
    assert mlflow_key(out) == out  # mended once for all


def test_mended_keys_stay_apart():
    keys = ["loss", "loss/", "/loss", "eval//loss", "eval/loss"]
    assert len({mlflow_key(k) for k in keys}) == len(keys)


@pytest.mark.parametrize("limit", [1, 5, 14, 15, 16, 100, 6000])
def test_truncate_never_exceeds_its_limit_and_marks_the_cut(limit):
    long = "x" * (limit + 50)
    out = truncate(long, limit)
    assert len(out) <= limit
    if limit >= len("...[truncated]"):
        assert out.endswith("...[truncated]") and long.startswith(out[:-len("...[truncated]")])


def test_truncate_leaves_what_fits_alone_and_stringifies():
    assert truncate("abc", 3) == "abc" and truncate(12345, 5) == "12345" and truncate(None, 10) == "None"
    assert truncate({"a": 1}, 100) == "{'a': 1}"


def test_artifact_paths_follow_the_layout_contract():
    assert step_path("spikes/highlight", 100, "html") == "spikes/highlight/step_000100.html"
    assert step_path("k", None, "png") == "k/step_000000.png"  # no step: step 0
    assert step_path("k", 1234567, "csv") == "k/step_1234567.csv"  # wider than 6 digits: not cut
    assert table_part_path("spikes/tokens", 7) == "spikes/tokens/step_000007.json"
    assert sorted(step_path("k", s, "json") for s in (10, 9, 100)) == [step_path("k", s, "json") for s in (9, 10, 100)]
