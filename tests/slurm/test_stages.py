"""SFT and PPO submitted through slurm/launch.py to the real 2-node cluster (1 CPU rank per node), plain and
nemo-run backends: the jobs complete and every per-step metric is bit-identical to the same stage run locally
with `megatron-rlhf launch --nproc-per-node 2`. The node names (n1, n2) do not resolve: the jobs rendezvous on
the NodeAddr Slurm uses; a rendezvous host that does not resolve fails within seconds, in one line."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.distributed.launch import ROOT, child_env
from tests.slurm.cluster import cluster_yaml, free_port_block
from tests.slurm.stages import assert_same_metrics, ppo_config, run_dir, run_local, sft_config, step_metrics


def _submit_both(slurm, stage, config_of, tmp_path):
    """The stage submitted with each backend (configs from `config_of(name)`) -> {backend: (job id, config)}."""
    jobs = {}
    for backend in ("plain", "nemo-run"):
        config = config_of(f"{stage}-{backend}")
        yaml = cluster_yaml(tmp_path / f"cluster-{backend}.yaml", tmp_path / "logs", master_port=free_port_block(1))
        jobs[backend] = (slurm.submit(stage, config, cluster_yaml=yaml, backend=backend,
                                      env={"NEMORUN_HOME": str(tmp_path / "nemorun_home")}), config)
    return jobs


def _check_completed(slurm, jobs, reference):
    for backend, (job_id, config) in jobs.items():
        info = slurm.wait_final(job_id, timeout=400)
        log = slurm.log(job_id)
        assert info["JobState"] == "COMPLETED", (backend, info, log[-3000:])
        assert info["NumNodes"] == "2" and info["Restarts"] == "0", (backend, info)
        # Both nodes ran, and rendezvoused on the address Slurm uses for n1 (the name itself does not resolve).
        assert "node 0/2" in log and "node 1/2" in log and "master 127.0.0.1:" in log, log[-3000:]
        assert_same_metrics(run_dir(config), reference)


def test_sft_on_two_slurm_nodes_matches_the_local_run(slurm, tiny, tmp_path):
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("n1", 29500)  # the jobs below cannot rendezvous on the node name
    jobs = _submit_both(slurm, "sft", lambda name: sft_config(tiny["data"], tmp_path, name), tmp_path)
    script = (tmp_path / "logs" / "megatron-rlhf-sft.sbatch").read_text()
    # A CPU partition: no --gpus-per-node (no gres/gpu here); the task gets every CPU of a node (sinfo).
    assert "--gpus-per-node" not in script and f"#SBATCH --cpus-per-task={os.cpu_count()}" in script, script
    _check_completed(slurm, jobs, run_dir(tiny["sft"]))


def test_ppo_on_two_slurm_nodes_matches_the_local_run(slurm, tiny, tmp_path):
    sft_ckpt, rm_ckpt = run_dir(tiny["sft"]) / "checkpoints", run_dir(tiny["rm"]) / "checkpoints"
    reference = ppo_config(tiny["data"], sft_ckpt, rm_ckpt, tmp_path, "ppo-local")
    jobs = _submit_both(slurm, "ppo", lambda name: ppo_config(tiny["data"], sft_ckpt, rm_ckpt, tmp_path, name),
                        tmp_path)
    run_local("ppo", reference)  # while the jobs run
    _check_completed(slurm, jobs, run_dir(reference))
    assert any(k.startswith("ppo/") for row in step_metrics(run_dir(reference)).values() for k in row)  # PPO's own


def test_a_rendezvous_host_that_does_not_resolve_fails_in_seconds_naming_it(slurm, tiny, tmp_path):
    yaml = cluster_yaml(tmp_path / "cluster.yaml", tmp_path / "logs")
    start = time.monotonic()
    job = slurm.submit("sft", sft_config(tiny["data"], tmp_path, "sft"), cluster_yaml=yaml,
                       env={"MASTER_ADDR": "no-such-node.invalid"})  # node.sh keeps a MASTER_ADDR it is given
    info = slurm.wait_final(job, timeout=120)
    log = slurm.log(job)
    assert info["JobState"] == "FAILED", (info, log[-3000:])
    assert time.monotonic() - start < 90, log[-3000:]  # c10d alone would retry for 600 s
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "MASTER_ADDR=no-such-node.invalid does not resolve" in errors[0], log[-3000:]


def test_cpus_per_task_beyond_the_nodes_is_refused_at_submit(slurm, tiny, tmp_path):
    yaml = cluster_yaml(tmp_path / "cluster.yaml", tmp_path / "logs", cpus_per_task=96)
    proc = subprocess.run([sys.executable, "slurm/launch.py", "sft", str(tiny["sft"]), "--cluster", str(yaml)],
                          cwd=ROOT, env=child_env({"SLURM_CONF": slurm.conf}), capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: cpus_per_task=96 but the nodes of the default partition have at most "
                    rf"{os.cpu_count()} CPUs \(sinfo\)", line), line
    assert not slurm.run("squeue", "-h", "-o", "%i").stdout.strip()  # nothing was submitted


def test_env_sh_gives_each_rank_the_nodes_cpus(slurm, tmp_path):
    """slurm/env.sh: threads per rank = the job's CPUs on the node / ranks per node (was a fixed 8)."""
    out = tmp_path / "threads-%j.out"
    script = "bash -c 'unset OMP_NUM_THREADS; GPUS_PER_NODE=1; . slurm/env.sh; echo threads=$OMP_NUM_THREADS'"
    job = slurm.run("sbatch", "--parsable", "-N1", f"--cpus-per-task={os.cpu_count()}", f"--output={out}",
                    f"--wrap={script}").stdout.strip()
    slurm.wait_final(job, timeout=60)
    assert (tmp_path / f"threads-{job}.out").read_text().split() == [f"threads={min(os.cpu_count(), 8)}"]


# A run directory that nemo-run's own rewriting (without a container it replaces every "/nemo_run" in its sbatch
# script with its job directory) and the shell would both touch: spaces, `$`, `=`, single and double quotes.
ODD_RUN_DIR = ("runs", "nemo_run", "a b $HOME=1 'q' \"dq\"")


@pytest.mark.parametrize("backend", ["plain", "nemo-run"])
def test_overrides_reach_the_job_byte_for_byte(slurm, tiny, tmp_path, backend):
    run = tmp_path.joinpath(*ODD_RUN_DIR)
    yaml = cluster_yaml(tmp_path / "cluster.yaml", tmp_path / "logs", master_port=free_port_block(1))
    job = slurm.submit("sft", tiny["sft"], [f"logging.run_dir={run}"], cluster_yaml=yaml, backend=backend,
                       env={"NEMORUN_HOME": str(tmp_path / "nemorun_home")})
    info = slurm.wait_final(job, timeout=400)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED", (info, log[-3000:])
    assert_same_metrics(run, run_dir(tiny["sft"]))  # the job wrote where the user said, and trained
    # Its log says so in its last line: with the progress bar off a stage prints no step line of its own.
    assert log.strip().splitlines()[-1].startswith(f"sft: trained steps 1-6 of 6 in "), log[-3000:]
    assert log.strip().splitlines()[-1].endswith(f"; run directory {run}"), log[-3000:]
