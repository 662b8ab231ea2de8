"""The one error a bad config value raises (kept apart so every config module can import it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config value is out of range; the message names the field and what to set instead."""
