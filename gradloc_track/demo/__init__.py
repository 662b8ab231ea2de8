"""Reusable parts of the demo apps (the way Lightning keeps ``demos``): a small GPT (``model``),
an offline corpus and byte tokenizer (``data``), a cached BPE (``tokenizer``), injected data
outliers (``inject``), the optimizer and schedule (``optim``), the app's configs (``config``), a run
dir per example run (``out_dir``), the table that compares runs (``compare``) and prints at the end
of a multirun (``sweep``). The training loop itself is ``examples/train_lm.py``.
"""
