"""What a backend did not receive, said at ``finish()``: the run's closing lines on stderr.

A backend that failed from the start (W&B without a login, an MLflow server that never answered)
sent one warning at its first failure, mid-run, then every record to the spool; the run then ended
as if all was well. ``finish()`` now says, last, that the backend received nothing (or not all),
why, where the records are and the command that sends them; the backend's entry may say more
(``Backend.closing_hint``: W&B without a login, how to log in or keep the run on this machine,
offline mode then ``wandb sync``).
"""
from __future__ import annotations

from pathlib import Path

from ..backends import BACKENDS, title


def closing_lines(name: str, run_dir: Path, spool: Path, delivered: int, spooled: int, dropped: int,
                  error: str | None, artifacts_only: str | None = None) -> list[str]:
    """The lines for a backend that did not receive every record (none when it did). ``artifacts_only``: where
    the backend's artifact store is ("" when unknown), when it alone refused records (the metrics and the status went
    through)."""
    if not spooled and not dropped:
        return []
    who = title(name)
    what = "received NOTHING from this run" if delivered == 0 else "did not receive every record of this run"
    if artifacts_only is not None:  # ("": the backend did not say where its artifact store is)
        what = "did not take this run's spike files into its artifact store" + \
            (f" {artifacts_only}" if artifacts_only else "")
    why = f" ({error})" if error else ""
    lines = [f"gradloc-track: {who} {what}{why}."]
    if spooled:
        lines.append(f"  {spooled} record(s) are kept in {spool}; send them to the run with:")
        hint = BACKENDS[name].closing_hint(run_dir, error) if name in BACKENDS else None
        if hint:  # the backend's own way to the run (W&B without a login: log in, or offline)
            lines += hint
        else:
            once = "its artifact store takes writes" if artifacts_only is not None else f"{who} is reachable"
            lines.append(f"    gradloc-track replay {run_dir}        # once {once}")
    if dropped:
        lines.append(f"  {dropped} record(s) are LOST: neither {who} nor the spool could take them")
    return lines
