"""``config/renamed``: an old key fails naming the new key and its option; the table itself points
at keys that exist in the option's schema and away from keys that no longer do."""
from __future__ import annotations

import dataclasses

import pytest

from gradloc_track.config import CLIP_SCHEMAS, ConfigError
from gradloc_track.config.renamed import RENAMED_KEYS, Renamed, check_renamed


def test_the_hint_names_the_new_key_and_its_option():
    assert Renamed("clip.alpha", "clip=layerclip").hint() == "renamed: use clip.alpha with clip=layerclip"


def test_keys_that_were_never_renamed_pass():
    check_renamed([])
    check_renamed(["clip.warmup_steps", "monitor.log_every", "clip"])  # not even a prefix match
    check_renamed(iter(["clip.beta"]))


def test_every_renamed_key_given_is_named_in_one_error_in_the_order_given():
    with pytest.raises(ConfigError) as info:
        check_renamed(["monitor.log_every", "clip.layer_alpha", "clip.zclip_warmup_steps"])
    msg = str(info.value)
    assert msg.startswith("renamed config key(s): clip.layer_alpha (renamed: use clip.alpha with clip=layerclip); "
                          "clip.zclip_warmup_steps (renamed: use clip.warmup_steps with clip=zclip). ")
    assert "monitor.log_every" not in msg and "conf/clip/" in msg


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_each_new_key_is_a_field_of_its_options_schema_and_the_old_one_of_none(old):
    new = RENAMED_KEYS[old]
    group, option = new.option.split("=")
    assert group == "clip" and new.new.startswith("clip.")
    fields = {f.name for f in dataclasses.fields(CLIP_SCHEMAS[option])}
    assert new.new.split(".", 1)[1] in fields
    assert not any(old.split(".", 1)[1] in {f.name for f in dataclasses.fields(s)} for s in CLIP_SCHEMAS.values())
