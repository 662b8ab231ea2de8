"""Reusable parts of the demo apps (the way Lightning keeps ``demos``): a small GPT (``model``),
an offline corpus and byte tokenizer (``data``), a cached BPE (``tokenizer``), injected data
outliers (``inject``), the optimizer and schedule (``optim``), what the apps print (``console``)
and the app's configs (``config``). The training loop itself is ``examples/train_lm.py``.
"""
