"""hardware: gpu_multiprocess -> jax.distributed.initialize() only where a cluster is found."""
from dropless.runtime.distributed import decide, detect_cluster

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-32]", "SLURM_NTASKS": "128",
         "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}


def test_not_distributed_does_nothing_whatever_the_environment():
    d = decide(False, SLURM)
    assert not d.initialize and d.message == ""


def test_cluster_environments_are_detected():
    assert decide(True, SLURM).initialize and decide(True, SLURM).cluster == "SLURM"
    assert detect_cluster({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"}) == "Open MPI"
    assert detect_cluster({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}).startswith("explicit")
    # an interactive SLURM shell (no job step) is not a multi-process launch
    assert detect_cluster({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}) is None


def test_no_cluster_runs_one_process_and_says_so():
    d = decide(True, {"HOME": "/root"})
    assert not d.initialize and "running as one process, it changes nothing" in d.message


def test_start_on_one_cpu_process_notes_it_once(monkeypatch):
    """`dropless train`'s start-up with the recipe's hardware key on this machine: nothing to
    set, no cluster, one note each (the run goes on as one process)."""
    from dropless.config_file import build_config
    from dropless.runtime.distributed import start
    from dropless.train.overflow import startup_notes
    for name in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "JAX_COORDINATOR_ADDRESS",
                 "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    notes: list[str] = []
    cfg = build_config([("hardware", "gpu_multiprocess"), ("capacity_factor", 1.0),
                        ("te_ep_overflow_check_every_n_steps", 20)], notes=notes)
    lines: list[str] = []
    start(cfg, notes + notes, echo=lines.append, late_notes=startup_notes(cfg))  # as cli/train
    assert lines[0].startswith("XLA_FLAGS=")
    got = [ln for ln in lines if ln.startswith("note: ")]
    assert len(got) == 3 and len(set(got)) == 3
    assert any("running as one process" in ln for ln in got)
    assert any("overflow_check_every_n_steps=20" in ln for ln in got)
