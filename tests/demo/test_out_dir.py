

def test_a_sweep_jobs_folder_name_is_cut_with_a_hash_of_its_overrides():
    from omegaconf import OmegaConf

    from gradloc_track.demo.out_dir import JOB_DIR_CHARS, job_dir_name, register_job_dir_resolver

    assert job_dir_name(3, "clip=adagc,train.seed=1") == "3_clip=adagc,train.seed=1"  # short: as Hydra names it
    a, b = ("clip=adagc," + "x" * 300), ("clip=adagc," + "x" * 299 + "y")
    assert len(job_dir_name(0, a)) == len("0_") + JOB_DIR_CHARS and job_dir_name(0, a).startswith("0_clip=adagc,x")
    assert job_dir_name(0, a) != job_dir_name(0, b)  # the same head: the hash tells them apart
    register_job_dir_resolver()
    register_job_dir_resolver()  # idempotent
    cfg = OmegaConf.create({"num": 1, "over": a, "dir": "${gradloc_job_dir:${num},${over}}"})
    assert cfg.dir == job_dir_name(1, a)
