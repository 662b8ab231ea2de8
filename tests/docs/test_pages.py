"""The docs as users read them: a README that is a front door (at most 220 lines), no version-history asides
("(0.2: 2.26)", "0.3's detector"), and timings and notes about the machine only in docs/benchmarks.md."""
from __future__ import annotations

import re

import pytest

from .snippets import DOCS, ROOT

PAGES = [p for p in DOCS if p.name != "benchmarks.md"]
# our own 0.1-0.5 (a third party's "verl 0.9" is no aside); "(0.05)" is a value, "(0.2: 2.26)" an aside
ASIDE = re.compile(r"\(0\.[1-5]: |\b0\.[1-5]'s\b|\b(?:in|since|before|unlike) 0\.[1-5]\b|"
                   r"\b0\.[1-5] (?:had|accepted|drew|found|fell|rejected|compared|logged|fired)\b", re.I)
MACHINE = re.compile(r"\bbusy\b|load average|\b2-core machine\b|shared (?:2-core|cores)|\bon 2 cores\b", re.I)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines: move manual material to docs/"
    heads = [ln for ln in lines if ln.startswith("## ")]
    assert heads[:1] == ["## Two commands"] and "## Documentation" in heads


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_version_history_asides(page):
    found = [m.group(0) for m in ASIDE.finditer(page.read_text(encoding="utf-8"))]
    assert not found, f"{page.name}: {found}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_notes_about_the_machine_live_in_benchmarks(page):
    text = page.read_text(encoding="utf-8")
    found = [text[max(0, m.start() - 40):m.end() + 20] for m in MACHINE.finditer(text)]
    assert not found, f"{page.name}: {found} (docs/benchmarks.md holds timings and machine notes)"


def test_the_checks_catch_what_they_are_for():
    assert ASIDE.search("AdaGC 1.026 (0.2: 2.26)") and ASIDE.search("0.3's detector") and ASIDE.search("In 0.3 default")
    assert not ASIDE.search("dropout 0.1, lr 0.02 (0.5 s)") and not ASIDE.search("z = 0.5 (0.05)")
    assert not ASIDE.search("verl 0.9's engine") and not ASIDE.search("sqrt(0.5) of the norm")
    assert MACHINE.search("48 s wall on 2 busy cores") and MACHINE.search("busybox") is None
