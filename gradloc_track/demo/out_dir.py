"""Each example run gets a run dir of its own, as the Hydra app's do.

``examples/train_lm.py`` writes under ``runs/<date>_<time>_<µs>`` (Hydra's run dir); the argparse
examples did write to a fixed ``runs/<example>``, so ``hf_trainer.py --report-to none`` and its MLflow
variant shared one dir and the second run took the first one's files and run record over.
``run_dir_for(out, "hf_trainer")``: ``--out`` as given (refused when it already holds a run), else
``runs/hf_trainer/<date>_<time>_<µs>``, new on every start.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path


_last: list[str] = [""]  # the previous stamp of this process: two calls in one microsecond differ too


def stamp() -> str:
    """``2026-11-25_17-39-28_885223``: the form of Hydra's run dirs (microseconds: two starts in one
    second get two dirs)."""
    while True:
        now = time.time()
        out = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now)) + f"_{int(now % 1 * 1e6):06d}"
        if out != _last[0]:
            _last[0] = out
            return out
        time.sleep(1e-5)


def run_dir_for(out: str | Path | None, example: str, base: str | Path = "runs") -> Path:
    """The run dir of one example run: ``out`` when given and free, else a new ``<base>/<example>/<stamp>``.
    An ``out`` that holds a run already raises ``ValueError`` naming the fix (one run per run dir)."""
    from ..run_dirs import is_run_dir

    if out is None:
        while True:  # another process may have started in the same microsecond
            path = Path(base) / example / stamp()
            if not path.exists():
                return path
    path = Path(out)
    if is_run_dir(path):
        raise ValueError(f"--out {path} holds a run already (one run per run dir): pass a new folder, or leave "
                         f"--out out for a new runs/{example}/<date>_<time> dir")
    return path


def check_out_dir(argv: list[str]) -> str | None:
    """What is wrong with the folder an ``out_dir=`` (or ``hydra.run.dir=`` / ``hydra.sweep.dir=``) override names,
    before Hydra makes its run dir there: a folder that cannot be made there gave a pathlib traceback naming neither
    the override nor the fix (held-out tester, stop 64: ``out_dir=/proc/nope``). None when it can be made (it is,
    now: Hydra would make it the next moment) or no such override is given. A value in Hydra's override grammar
    (a sweep ``a,b``, ``choice(...)``, quotes, an interpolation) and a command that runs no job (``--cfg``,
    ``--help``, ``--info``) are left to Hydra: nothing is made for them (review, stop 64)."""
    import os

    if any(a.startswith(("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i")) for a in argv):
        return None
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or key not in ("out_dir", "hydra.run.dir", "hydra.sweep.dir") or not value or \
                any(ch in value for ch in ",()[]{}'\"$*\\ "):
            continue
        try:
            Path(value).mkdir(parents=True, exist_ok=True)
            if not os.access(value, os.W_OK | os.X_OK):
                raise PermissionError(f"no write permission on {value}")
        except OSError as exc:
            return (f"{key}={value}: the run's folder cannot be made there ({exc.strerror or exc}); "
                    f"pass {key}=<a folder you can write to> (the default out_dir is ./runs)")
    return None


JOB_DIR_BYTES = 100  # a sweep job's folder name keeps at most this much of its overrides (file names: 255 bytes)
JOB_DIR_RESOLVER = "gradloc_job_dir"  # ``conf/config.yaml``'s ``hydra.sweep.subdir``


def job_dir_name(num: object, overrides: str) -> str:
    """A sweep job's folder, ``<num>_<its overrides>``, cut to ``JOB_DIR_BYTES`` bytes (UTF-8: the file system's
    limit is in bytes, and the demo's own injected text is non-ASCII) with a hash of the whole when longer: a
    sweep of many overrides died with "File name too long" before any job ran (held-out tester, stop 55: 18
    overrides, 300 characters). The job's full overrides stay in its ``.hydra/overrides.yaml``."""
    raw = overrides.encode(errors="surrogateescape")  # a command line in no UTF-8 comes with surrogates
    if len(raw) <= JOB_DIR_BYTES:
        return f"{num}_{overrides}"
    digest = hashlib.sha1(raw).hexdigest()[:8]
    head = raw[:JOB_DIR_BYTES - 9].decode(errors="ignore").rstrip(",")  # never half a character
    return f"{num}_{head}~{digest}"


def register_job_dir_resolver() -> None:
    """Make ``${gradloc_job_dir:num,overrides}`` resolvable (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(JOB_DIR_RESOLVER):
        OmegaConf.register_new_resolver(JOB_DIR_RESOLVER, job_dir_name)
