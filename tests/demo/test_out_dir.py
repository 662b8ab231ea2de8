"""A sweep job's folder name (``demo/out_dir.py``): Hydra's ``<num>_<overrides>``, cut with a hash when long."""
from __future__ import annotations

from omegaconf import OmegaConf

from gradloc_track.demo.out_dir import JOB_DIR_BYTES, job_dir_name, register_job_dir_resolver


def test_a_sweep_jobs_folder_name_is_cut_with_a_hash_of_its_overrides():
    assert job_dir_name(3, "clip=adagc,train.seed=1") == "3_clip=adagc,train.seed=1"  # short: as Hydra names it
    a, b = ("clip=adagc," + "x" * 300), ("clip=adagc," + "x" * 299 + "y")
    assert len(job_dir_name(0, a)) == len("0_") + JOB_DIR_BYTES and job_dir_name(0, a).startswith("0_clip=adagc,x")
    assert job_dir_name(0, a) != job_dir_name(0, b)  # the same head: the hash tells them apart
    register_job_dir_resolver()
    register_job_dir_resolver()  # idempotent
    cfg = OmegaConf.create({"num": 1, "over": a, "dir": "${gradloc_job_dir:${num},${over}}"})
    assert cfg.dir == job_dir_name(1, a)


def test_the_cut_counts_bytes_and_never_splits_a_character():
    """Review, stop 55: cut by characters, 80 x '€' (3 bytes each) was never cut and the folder name ran past
    the file system's 255 bytes; the demo's own injected text is non-ASCII."""
    text = "train.inject.text=" + "€" * 80  # 258 bytes, 98 characters
    name = job_dir_name(0, text)
    assert len(name.encode()) <= len("0_") + JOB_DIR_BYTES and "~" in name
    assert name.encode().decode() == name and name.startswith("0_train.inject.text=€")


def test_an_out_dir_that_cannot_be_made_names_the_override_and_the_fix(tmp_path):
    """Held-out tester, stop 64: ``out_dir=/proc/nope`` ended in a pathlib traceback from inside Hydra."""
    from gradloc_track.demo.out_dir import check_out_dir

    (tmp_path / "a_file").write_text("x")
    bad = str(tmp_path / "a_file" / "runs")
    for key in ("out_dir", "hydra.run.dir", "hydra.sweep.dir"):
        said = check_out_dir(["experiment=spike_demo", f"{key}={bad}"])
        assert said.startswith(f"{key}={bad}: the run's folder cannot be made there (") and \
            f"pass {key}=<a folder you can write to>" in said
    good = tmp_path / "new" / "runs"
    assert check_out_dir([f"out_dir={good}", "out_dir_typo", "hydra.run.dir=${out_dir}/x"]) is None and good.is_dir()
    assert check_out_dir(["train.steps=3"]) is None
    # Hydra's grammar and commands that run no job are left to Hydra: nothing made (review, stop 64)
    for argv in (["-m", f"out_dir={tmp_path}/s_a,{tmp_path}/s_b"], [f"out_dir='{tmp_path}/my runs'"],
                 [f"out_dir=choice({tmp_path}/x,{tmp_path}/y)"], ["--cfg", "job", f"out_dir={tmp_path}/cfg_only"]):
        assert check_out_dir(argv) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "new"]
