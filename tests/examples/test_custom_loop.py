"""examples/custom_loop.py, the README's "Use it in your loop": it runs as shipped (its own data,
model and injected garbled answer), the detector fires on the injected step only, the spike block
names the garbled sample, the artifacts are written, and the README shows the example's lines."""
from __future__ import annotations

import re

from gradloc_track.artifacts import read_table

from ..conftest import ROOT
from .load import load_example


def test_the_custom_loop_finds_the_garbled_answer_and_prints_the_block(tmp_path, capsys):
    example = load_example("custom_loop")
    run_dir = tmp_path / "run"
    assert example.main(["--out", str(run_dir)]) == [100]  # the injected step, and no other
    out = capsys.readouterr().out
    block = out[out.index("── spike at step 100"):out.index("done:")]
    culprit = re.search(r"culprits   sample 3, the whole sample: '(.*)'  \((\d+)% of", block)
    assert culprit and example.GARBLED[:20] in culprit.group(1) and int(culprit.group(2)) > 50, block
    assert f"local files: {run_dir / 'spikes'}" in block
    assert (run_dir / "spikes" / "highlight" / "step_000100.html").is_file()
    table = read_table(run_dir, "spikes/tokens")
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert any(r["level"] == "sample" and r["sample"] == 3 and r["step"] == 100 for r in rows)
    assert f"gradloc-track report {run_dir}" in out


def test_the_readme_shows_the_examples_own_lines():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it in your loop"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", section.index("```python\n") + 10)]
    example = (ROOT / "examples" / "custom_loop.py").read_text()
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("...")]
    assert len(lines) >= 15
    missing = [ln for ln in lines if ln.strip() not in example]
    assert not missing, missing
