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
