"""An example started without its dependencies stops with an ImportError that names the one install line."""
from __future__ import annotations

import sys

import pytest

from gradloc_track.demo.extras import need

from ..examples.load import load_example


def test_need_names_every_missing_module_and_the_examples_extra(monkeypatch):
    need("torch", "hydra")
    monkeypatch.setitem(sys.modules, "trl", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"'trl', 'datasets' are not installed; this example needs them\. Install "
                                          r"every example's dependencies with: pip install 'gradloc-track\[examples\]' "
                                          r"\(from a clone: pip install -e '\.\[examples\]'\)"):
        need("torch", "trl", "datasets")


@pytest.mark.parametrize("name,module", [("hf_trainer", "transformers"), ("trl_grpo", "trl"),
                                         ("trl_sft_packing", "trl"), ("lightning_lm", "lightning")])
def test_each_framework_example_says_which_line_installs_what_it_misses(name, module, monkeypatch, tmp_path):
    example = load_example(name)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=rf"'{module}' is not installed.*pip install 'gradloc-track\[examples\]'"):
        example.main(["--out", str(tmp_path)])
