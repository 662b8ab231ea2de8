"""``config/_validate``: each validator's accept/refuse boundary, the annotation matcher against a
hand-written table of (value, annotation, verdict), and ``unknown_keys`` on a composed node.

(The module is ``_validate.py``; its test drops the leading underscore.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import pytest
from omegaconf import OmegaConf

from gradloc_track.config import ConfigError
from gradloc_track.config._validate import (check, check_types, finite, in_unit_interval, integer, node_schema,
                                            non_negative, number, one_of, positive, unknown_keys)


def test_check_names_the_field_the_value_and_the_fix():
    check(True, "a.b", 1, "never shown")
    with pytest.raises(ConfigError) as info:
        check(False, "clip.beta", 1.5, "use a value below 1")
    assert str(info.value) == "clip.beta=1.5 is invalid: use a value below 1"


def test_one_of_lists_the_choices():
    one_of("mode", "a", ("a", "b"))
    one_of("mode", "b", iter(["a", "b"]))  # any iterable, read once
    with pytest.raises(ConfigError, match=r"mode='c' is invalid: use one of 'a', 'b'$"):
        one_of("mode", "c", ["a", "b"])


INF, NAN = float("inf"), float("nan")
# value -> (number, positive, non_negative, in_unit_interval): the rules written out by hand
NUMBER_TABLE = [
    (1, (True, True, True, False)),
    (0.5, (True, True, True, True)),
    (0, (True, False, True, False)),
    (0.0, (True, False, True, False)),
    (-1e-9, (True, False, False, False)),
    (1.0, (True, True, True, False)),
    (1e-300, (True, True, True, True)),
    (INF, (True, False, False, False)),
    (NAN, (True, False, False, False)),
    (True, (False, False, False, False)),  # a bool is not a number here
    ("0.5", (False, False, False, False)),
    (None, (False, False, False, False)),
]


@pytest.mark.parametrize("value,verdicts", NUMBER_TABLE, ids=repr)
def test_number_rules_accept_exactly_what_the_table_says(value, verdicts):
    rules = (lambda v: number("f", v, "1"), lambda v: positive("f", v, "1"), lambda v: non_negative("f", v, "1"),
             lambda v: in_unit_interval("f", v))
    for rule, ok in zip(rules, verdicts):
        if ok:
            rule(value)
        else:
            with pytest.raises(ConfigError, match=r"^f="):
                rule(value)


def test_a_wrong_type_is_named_before_the_range():
    with pytest.raises(ConfigError, match=r"lambda_rel='1.04' is invalid: use a number \(e.g. 1.04\), not str"):
        positive("lambda_rel", "1.04", "1.04")
    with pytest.raises(ConfigError, match=r"use a positive finite value \(e.g. 2\)"):
        positive("x", -1, "2")
    with pytest.raises(ConfigError, match=r"use a value strictly between 0 and 1 \(e.g. 0.99\)"):
        in_unit_interval("beta", 1)


@pytest.mark.parametrize("value,minimum,ok", [(3, 3, True), (2, 3, False), (0, 0, True), (-1, 0, False),
                                              (True, 0, False), (3.0, 0, False), ("3", 0, False)])
def test_integer_is_a_whole_number_at_least_the_minimum(value, minimum, ok):
    if ok:
        integer("n", value, minimum, "5")
    else:
        with pytest.raises(ConfigError, match=rf"use a whole number >= {minimum} \(e.g. 5\)"):
            integer("n", value, minimum, "5")


def test_finite():
    finite("x", -1e308)
    for bad in (INF, -INF, NAN):
        with pytest.raises(ConfigError, match="use a finite value"):
            finite("x", bad)


@dataclass
class Inner:
    k: int = 1


@dataclass
class Typed:
    i: int = 0
    f: float = 0.0
    b: bool = False
    s: str = ""
    o: Optional[float] = None
    u: Union[int, str] = 0
    ls: list[str] = field(default_factory=list)
    pair: tuple[float, float] = (0.0, 0.0)
    ints: tuple[int, ...] = ()
    m: dict[str, float] = field(default_factory=dict)
    anything: Any = None
    inner: Inner = field(default_factory=Inner)


# (field, value, accepted): what each annotation takes, by hand
TYPE_TABLE = [
    ("i", 3, True), ("i", True, False), ("i", 3.0, False), ("i", "3", False),
    ("f", 3, True), ("f", 3.5, True), ("f", False, False), ("f", "3.5", False),
    ("b", True, True), ("b", 1, False),
    ("s", "x", True), ("s", 1, False), ("s", None, False),
    ("o", None, True), ("o", 2, True), ("o", "2", False),
    ("u", 2, True), ("u", "x", True), ("u", 2.5, False),
    ("ls", ["a", "b"], True), ("ls", ("a",), True), ("ls", [], True), ("ls", ["a", 1], False), ("ls", "ab", False),
    ("pair", [0.9, 1], True), ("pair", (0.9,), False), ("pair", [0.9, 0.95, 0.1], False), ("pair", [0.9, "x"], False),
    ("ints", [1, 2, 3], True), ("ints", [], True), ("ints", [1, 2.0], False),
    ("m", {"a": 1.0}, True), ("m", {}, True), ("m", {"a": "x"}, False), ("m", {1: 1.0}, False), ("m", [1], False),
    ("anything", object(), True),
    ("inner", Inner(), True), ("inner", 5, False),
]


@pytest.mark.parametrize("name,value,ok", TYPE_TABLE, ids=lambda v: repr(v)[:20])
def test_check_types_takes_what_each_annotation_allows(name, value, ok):
    obj = Typed()
    setattr(obj, name, value)
    if ok:
        check_types(obj, "grp")
    else:
        with pytest.raises(ConfigError, match=rf"^grp\.{name}="):
            check_types(obj, "grp")


@pytest.mark.parametrize("name,value,described", [
    ("i", "x", "use an integer"),
    ("o", "x", "use a number or null"),
    ("u", 2.5, "use an integer or a string"),
    ("ls", "ab", "use a list of strings"),
    ("pair", [1.0], "use a list of 2 numbers"),
    ("ints", "x", "use a list of integers"),
    ("m", [1], "use a mapping"),
    ("inner", 5, "use Inner"),
])
def test_the_fix_reads_as_english(name, value, described):
    obj = Typed()
    setattr(obj, name, value)
    with pytest.raises(ConfigError) as info:
        check_types(obj, "")
    assert str(info.value).startswith(f"{name}=") and str(info.value).endswith(described)


def test_check_types_skips_the_fields_the_caller_checks_itself():
    obj = Typed(i="not checked here")
    check_types(obj, "grp", skip=("i",))
    with pytest.raises(ConfigError, match=r"grp\.i="):
        check_types(obj, "grp")


@dataclass
class Child:
    alpha: float = 0.5


@dataclass
class Special(Child):
    beta: float = 0.1


@dataclass
class Root:
    name: str = "x"
    child: Child = field(default_factory=Child)
    free: dict[str, str] = field(default_factory=dict)


def composed(schema: type, **extra: Any):
    """A structured DictConfig opened for new keys, as Hydra's ``+key=value`` leaves it."""
    cfg = OmegaConf.structured(schema)
    OmegaConf.set_struct(cfg, False)
    for dotted, value in extra.items():
        OmegaConf.update(cfg, dotted.replace("__", "."), value, force_add=True)
    return cfg


def test_unknown_keys_names_each_key_and_the_closest_valid_one():
    assert unknown_keys(composed(Root), Root) == []
    cfg = composed(Root, nme="y", child__alpah=0.1, child__zzz=1)
    assert unknown_keys(cfg, Root) == ["child.alpah (did you mean child.alpha?)", "child.zzz (valid keys: alpha)",
                                       "nme (did you mean name?)"]  # in the node's key order


def test_free_form_mappings_and_hydras_own_node_are_not_unknown():
    cfg = composed(Root, free__anything="ok", hydra={"run": {"dir": "."}})
    assert unknown_keys(cfg, Root) == []
    assert unknown_keys(cfg.child, Child, "child.") == []


@dataclass
class Clip:
    name: str = "zclip"


@dataclass
class WithClip:
    clip: Clip = field(default_factory=Clip)


def test_a_renamed_key_is_named_with_its_new_name():
    cfg = composed(WithClip, clip__zclip_warmup_steps=5)
    assert unknown_keys(cfg, WithClip) == ["clip.zclip_warmup_steps (renamed: use clip.warmup_steps with clip=zclip)"]


def test_node_schema_is_the_options_own_subclass_else_the_declared_one():
    assert node_schema(OmegaConf.structured(Special), Child) is Special
    assert node_schema(OmegaConf.structured(Child), Child) is Child
    assert node_schema(OmegaConf.structured(Root), Child) is Child  # unrelated: the declared one
    assert node_schema(OmegaConf.create({"alpha": 1.0}), Child) is Child  # an untyped node
    cfg = composed(Root)
    cfg.child = OmegaConf.structured(Special)  # an option's own schema under the declared field
    assert unknown_keys(cfg, Root) == []  # beta is Special's field, not unknown
    assert math.isclose(cfg.child.beta, 0.1)
