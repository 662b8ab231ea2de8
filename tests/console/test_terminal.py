"""TrainConsole: a plain log when not a tty; a block that cannot be printed warns, never raises."""
from __future__ import annotations

import io
import json

from gradloc_track.console import TrainConsole


from .cases import mojibake_view


def test_plain_console_prints_a_tenth_of_the_steps_when_not_a_tty():
    out = io.StringIO()
    con = TrainConsole(stream=out)
    con.start(100)
    for s in range(100):
        con.step(s, 2.0, 0.5)
    con.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1] == "[100/100] step  99  loss 2.000  grad norm 0.5"
    assert lines[0] == "[  1/100] step   0  loss 2.000  grad norm 0.5"  # the step number the tracker shows
    json.dumps(lines)


def test_a_block_that_cannot_be_printed_warns_and_never_raises(tmp_path, recwarn):
    view = mojibake_view()
    view.context.tokenizer = None
    view.context.input_ids = "not a tensor"
    TrainConsole(stream=io.StringIO()).spike(view, tmp_path)
    assert any("could not print the spike block of step 100" in str(w.message) for w in recwarn)


def test_the_console_writes_to_stdout_by_default(capsys):
    """A run's console is its output: ``python examples/x.py > log.txt`` keeps the blocks and the summary."""
    TrainConsole().summary(["done: 3 steps"])
    out, err = capsys.readouterr()
    assert out == "done: 3 steps\n" and err == ""


def test_a_console_on_stderr_writes_where_stderr_is_at_each_print():
    """``watch()``'s and the callbacks' blocks follow ``contextlib.redirect_stderr`` and pytest's capture (held-out
    tester, stop 56: they went to the stderr ``watch()`` had found when it was called)."""
    import contextlib
    import io

    from gradloc_track.console import TrainConsole

    console = TrainConsole(stream="stderr", rich=False)
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        console.print("── spike at step 3")
    assert buf.getvalue() == "── spike at step 3\n"


def test_an_incident_firing_on_every_step_prints_a_few_of_its_aftermath_lines(tmp_path):
    """Issue 37, 'not one event per step': a weight that stays corrupt printed one aftermath line on each of 100
    skipped steps (held-out zoo, GPT-2). The console prints the incident's first five, then its 8th, 16th, 32nd
    and 64th with the count; a new incident counts from 1 again; a full block is never held back."""
    import dataclasses

    from gradloc_track.console import SpikeView

    from .cases import EVENT

    def later(step: int, first: int) -> SpikeView:
        ev = dataclasses.replace(EVENT, step=step, cause="numeric",
                                 cause_detail=f"aftermath of step {first} (numeric): a weight is absurd: ...")
        return SpikeView(step, [ev], not_localized="a weight is corrupt", aftermath_of=first)

    out = io.StringIO()
    con = TrainConsole(stream=out)
    con.spike(mojibake_view(100), tmp_path)  # the incident's own block
    for step in range(101, 201):
        con.spike(later(step, 100), tmp_path)
        if step == 110:  # a localized aftermath step in the flood: its whole block, not counted (review)
            full = mojibake_view(110)
            full.aftermath_of = 100
            con.spike(full, tmp_path)
    lines = [ln for ln in out.getvalue().splitlines() if "aftermath of step 100" in ln]
    assert [int(ln.split()[4].rstrip(":")) for ln in lines] == [101, 102, 103, 104, 105, 108, 116, 132, 164]
    assert lines[4].endswith("not localized")  # the first five as they were
    assert lines[5].endswith("[its 8th one-line aftermath step; shown next: the 16th; each is a row of spikes/events]")
    assert lines[7].endswith("[its 32nd one-line aftermath step; shown next: the 64th; each is a row of "
                             "spikes/events]")
    assert out.getvalue().count("── spike at step 100 ──") == 1 and "sample" in out.getvalue()
    assert out.getvalue().count("── spike at step 110 ──") == 1  # the localized one, whole
    out.truncate(0)
    out.seek(0)
    for step in range(301, 304):  # a second incident: its own first lines
        con.spike(later(step, 300), tmp_path)
    assert len(out.getvalue().splitlines()) == 3 and "[aftermath" not in out.getvalue()
