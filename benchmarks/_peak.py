"""Run one python command, then write its peak RSS in KiB to a file (for bench_ledger.py).

``python _peak.py OUT -m module args...`` or ``python _peak.py OUT -c code args...``. The peak is the
kernel's ``VmHWM`` of this process, read at exit: exec resets it, so unlike ``ru_maxrss`` it does not
count the pages of the benchmark process that forked this one.
"""
import atexit
import runpy
import sys


def _write_peak(out: str) -> None:
    with open("/proc/self/status", encoding="ascii") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(out, "w", encoding="ascii") as f:
        f.write(kib)


atexit.register(_write_peak, sys.argv[1])
mode, target, *rest = sys.argv[2:]
if mode == "-m":
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *rest]
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
