"""The handle's state inside a framework's checkpoint folder, so a resumed run goes on as the
uninterrupted one: AdaGC/ZClip keep their thresholds (no warm-up anew, no unclipped steps after
the resume) and the spike detector keeps its running statistics (no blind warm-up, no false
events on the first steps back). Trainer's ``checkpoint-N`` folders hold it as ``gradloc_track.pt``."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

STATE_FILE = "gradloc_track.pt"


def save_state(handle: Any, folder: str | Path) -> Path | None:
    """``handle.state_dict()`` into ``folder/gradloc_track.pt``; None (said) when the folder is not there."""
    import io

    import torch

    from ..trackers.files import atomic_write_bytes

    folder = Path(folder)
    if not folder.is_dir():
        warm = handle.warm_up_words()
        warnings.warn(f"gradloc-track: no checkpoint folder {folder} to save the handle's state in; a run resumed "
                      f"from it goes on without it{' (' + warm + ')' if warm else ''}", UserWarning, stacklevel=3)
        return None
    data = io.BytesIO()
    torch.save(handle.state_dict(), data)
    path = folder / STATE_FILE
    atomic_write_bytes(path, data.getvalue())  # a checkpoint never holds half a state file
    return path


def load_state(handle: Any, folder: str | Path, step: int) -> bool:
    """Load ``folder/gradloc_track.pt`` into ``handle``; a resume without it is said once, naming the file."""
    import torch

    path = Path(folder) / STATE_FILE
    if not path.is_file():
        warm = handle.warm_up_words()
        if warm:
            warnings.warn(f"gradloc-track: training resumes at step {step} but {path} is not there (a checkpoint "
                          f"written without GradLocCallback): {warm}", UserWarning, stacklevel=3)
        return False
    state = torch.load(path, map_location="cpu", weights_only=True)
    if int(state.get("steps", 0)) > step:  # more steps than the run has taken: another run's file
        warm = handle.warm_up_words()
        warnings.warn(f"gradloc-track: {path} holds the state after {state['steps']} steps, but training resumes at "
                      f"step {step}: it is another run's, not loaded{'; ' + warm if warm else ''}", UserWarning,
                      stacklevel=3)
        return False
    try:
        handle.load_state_dict(state)
    except ValueError as exc:  # a state that fits this clipper's kind but not its parameters: the way out
        raise type(exc)(f"{exc} (the saved state is {path}: delete it to start the clipper and the detector "
                        "afresh)") from exc
    return True
