"""Every scenario the distributed tests run, by world size: one process group per world size
runs them all (``conftest.dist_results``), since a launch costs seconds and tests share it."""
from __future__ import annotations

from functools import lru_cache

from . import gradloc_port

PORT_CASES = 12  # GradLoc port cases per world size (each a handful of probes)


def locate_scenarios(world: int) -> list[dict]:
    """locate() against the brute-force oracle and one process (test_locate_dist)."""
    last = world - 1
    two = [[0, 1, 5], [last, 0, 2]]
    cases = [
        {"name": "ddp_rank1", "wrap": "ddp", "culprits": [[1, 0, 3]]},
        {"name": "fsdp2_rank1", "wrap": "fsdp2", "culprits": [[1, 0, 3]]},
        {"name": "ddp_first_last", "wrap": "ddp", "culprits": two},
        {"name": "fsdp2_first_last", "wrap": "fsdp2", "culprits": two},
        {"name": "ddp_bisect", "wrap": "ddp", "culprits": two, "method": "bisect"},
        {"name": "fsdp2_gradloc", "wrap": "fsdp2", "culprits": [[1, 0, 3]], "method": "gradloc",
         "threshold": 3.0},
        {"name": "ddp_micro", "wrap": "ddp", "culprits": [[1, 1, 0, 3], [0, 0, 1, 6]], "micro": 2},
        {"name": "ddp_explicit", "wrap": "ddp", "culprits": [[1, 0, 3]], "threshold": 20.0},
    ]
    if world > 2:  # the method/micro-batch/threshold variants do not depend on the world size
        cases = [c for c in cases if c["name"] not in ("ddp_bisect", "ddp_micro", "ddp_explicit")]
    else:
        cases += [{"name": "ddp_empty_rank0", "wrap": "ddp", "culprits": [[1, 1, 6]], "empty": [0]}]
    return cases


ERRORS = [{"name": "fsdp2_bad_rank1", "wrap": "fsdp2", "culprits": [[1, 0, 3]], "bad_rank": 1, "kind": "error"}]
MONITOR = [{"name": "ddp_monitor", "wrap": "ddp", "culprits": [[1, 0, 3]], "kind": "monitor"}]


def nonfinite_scenarios(world: int) -> list[dict]:
    """NaN loss weights on one rank (or two), cells ``[k, rank, b, t]`` (test_nonfinite_dist):
    ``product`` losses carry the NaN into every probe of its micro-batch (named by the term-loss
    map), ``safe`` ones keep a masked-out NaN out (found by halving over every rank's samples),
    ``nomap`` ones carry it without a map (the rank whose forward is NaN is named)."""
    last = world - 1
    if world == 2:
        cases = [
            {"name": "nf_ddp_product", "wrap": "ddp", "nan": [[0, 1, 0, 3]], "loss": "product"},
            {"name": "nf_fsdp2_safe", "wrap": "fsdp2", "nan": [[0, 1, 1, 5]], "loss": "safe"},
            {"name": "nf_ddp_safe_micro", "wrap": "ddp", "nan": [[1, 1, 0, 2], [1, 1, 0, 6]], "loss": "safe",
             "micro": 2},
            {"name": "nf_ddp_nomap_micro", "wrap": "ddp", "nan": [[1, 1, 1, 4]], "loss": "nomap", "micro": 2},
        ]
    else:
        cases = [
            {"name": "nf_ddp_safe_two_ranks", "wrap": "ddp", "nan": [[0, 1, 0, 2], [0, last, 1, 6]], "loss": "safe"},
            {"name": "nf_fsdp2_product", "wrap": "fsdp2", "nan": [[0, last, 0, 3]], "loss": "product"},
        ]
    return [{**c, "kind": "nonfinite"} for c in cases]


# through GradMonitor: detected, localized, the step skipped on every rank
NONFINITE_MONITOR = [{"name": "nf_monitor", "wrap": "ddp", "nan": [[0, 1, 0, 3]], "loss": "product",
                      "kind": "nonfinite_monitor"}]


def failure_scenarios(world: int) -> list[dict]:
    """One rank fails during a localization (test_failure_dist): every method, both wrappings,
    each place a failure can be agreed on; the world-independent variants on 2 processes only."""
    last, two = world - 1, [[0, 1, 5], [world - 1, 0, 2]]
    cases = [
        {"name": "fail_ddp_auto_model", "wrap": "ddp", "culprits": two, "fail_rank": 1, "fail_at": 3,
         "where": "model"},
        {"name": "fail_ddp_bisect_loss", "wrap": "ddp", "culprits": two, "method": "bisect", "fail_rank": last,
         "fail_at": 3, "where": "loss"},
        {"name": "fail_fsdp2_gradloc_after", "wrap": "fsdp2", "culprits": [[1, 0, 3]], "method": "gradloc",
         "threshold": 3.0, "fail_rank": 1, "fail_at": 3, "where": "after"},
        {"name": "fail_fsdp2_auto_ghost", "wrap": "fsdp2", "culprits": two, "fail_rank": 0, "fail_at": 1,
         "where": "after"},
    ]
    if world == 2:
        cases += [
            {"name": "fail_ddp_micro1", "wrap": "ddp", "culprits": [[1, 1, 0, 3]], "micro": 2, "fail_rank": 0,
             "fail_at": 2, "where": "model", "stops_at": "probe 1, micro-batch 1"},  # the ghost pass's 2nd
            {"name": "fail_ddp_gradloc_copy", "wrap": "ddp", "culprits": [[1, 0, 3]], "method": "gradloc",
             "threshold": 3.0, "fail_rank": 1, "fail_at": 3, "where": "copy"},
            {"name": "fail_fsdp2_snapshot", "wrap": "fsdp2", "culprits": [[1, 0, 3]], "fail_rank": 1,
             "where": "snapshot"},
            {"name": "bad_loss_fsdp2", "wrap": "fsdp2", "culprits": [[1, 0, 3]], "method": "bisect", "fail_rank": 1,
             "fail_at": 2, "where": "float"},
        ]
    return [{**c, "kind": "failure"} for c in cases]


FAILURE_MONITOR = [{"name": "fail_monitor", "wrap": "ddp", "culprits": [[1, 0, 3]], "fail_rank": 1, "fail_at": 2,
                    "where": "loss", "kind": "failure_monitor"}]


@lru_cache(maxsize=None)
def _unit_threshold(case: str) -> float | None:
    from .levels_case import unit_threshold

    return unit_threshold(case)


FSDP2_ON_4 = ("document", "micro_batch", "two_micro_batches")  # packed rows, pieces, rows on two ranks


def levels_scenarios(world: int) -> list[dict]:
    """The single-process level scenarios on the shared global batch (test_levels_dist): every case
    under DDP and FSDP2 on 2 processes; on 4, every case under DDP and three under FSDP2
    (``FSDP2_ON_4``: the rules never see the wrapper, only the probes do; the suite stays short)."""
    from .levels_case import CASES

    cases = [{"name": f"lv_{case}_{wrap}", "kind": "levels", "wrap": wrap, "case": case,
              "threshold": _unit_threshold(case)} for case in CASES for wrap in ("ddp", "fsdp2")
             if wrap == "ddp" or world == 2 or case in FSDP2_ON_4]
    # rank 0 fails in the bad sample's confirmation (its loss_fn's call after the K of the ghost pass)
    return cases + [{"name": "lv_fail_sample_fsdp2", "kind": "levels", "wrap": "fsdp2", "case": "bad_sample",
                     "threshold": _unit_threshold("bad_sample"), "fail_rank": 0, "fail_at": 4 // world + 1,
                     "where": "after"}]  # after the forward: FSDP2's all-gathers ran on every rank


def port_cases(world: int) -> list[dict]:
    """GradLoc's rank search against the port (test_gradloc_dist), thresholds set here."""
    return [{**gradloc_port.with_threshold(c, world), "kind": "port"}
            for c in gradloc_port.make_cases(world, PORT_CASES)]


def all_scenarios(world: int) -> list[dict]:
    if world == 3:  # only GradLoc's uneven rank split needs 3 processes
        return port_cases(world)
    return (locate_scenarios(world) + ERRORS + (MONITOR + NONFINITE_MONITOR if world == 2 else [])
            + nonfinite_scenarios(world) + levels_scenarios(world)
            + port_cases(world) + failure_scenarios(world) + (FAILURE_MONITOR if world == 2 else []))
