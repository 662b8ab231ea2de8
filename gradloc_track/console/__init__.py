"""What a training run prints: a progress line, one block per spike, a summary at the end.

One console for every loop (the demo, ``examples/*``, the HF / TRL / Lightning callbacks):
``TrainConsole.spike(stats, run_dir)`` prints the block of a step's ``GradStats`` (the signal,
each culprit's text, level and share, surgery, the run's link, or why the spike was not
localized) and ``spike_summary(spikes, run_dir)`` the closing lines from the same stats, so the
summary always says what the blocks said. A culprit is named by what it is: ``sample 3``, an
RL ``completion 2 of group 1, reward 0.25`` (``sample_columns`` ``group``/``index``/``reward``),
a packed ``document 2`` (``document_ids``), and its text is that of its loss-bearing tokens
(an RL completion, not its padded prompt).

``culprits`` puts a culprit in words, ``block`` makes a spike's block, ``links`` says where to
look, ``summary`` makes the closing lines, ``terminal`` holds ``TrainConsole`` (the progress bar).
"""
from __future__ import annotations

from .block import spike_block, surgery_line
from .culprits import SpikeView, culprit_count, culprit_lines
from .links import event_page, highlight_page, spike_link, view_commands, where_to_look
from .summary import clip_saturation_line, closing_lines, spike_summary, summary_lines
from .terminal import TrainConsole

__all__ = ["SpikeView", "TrainConsole", "clip_saturation_line", "closing_lines", "culprit_count", "culprit_lines",
           "event_page", "highlight_page", "spike_block", "spike_link", "spike_summary", "summary_lines",
           "surgery_line", "view_commands", "where_to_look"]
