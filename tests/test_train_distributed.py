"""hardware: gpu_multiprocess -> jax.distributed.initialize() only where a cluster is found."""
from dropless.train.distributed import decide, detect_cluster

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
