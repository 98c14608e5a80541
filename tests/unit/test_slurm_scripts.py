"""Generated Slurm jobs for a 1-node (Llama-3-8B) and a 16-node (Llama-3-70B) recipe, plain and nemo-run
dry run: nodes, one task per node, GPUs, ranks, signal, requeue, container and environment."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from megatron_rlhf import cli, launch
from megatron_rlhf.config.cluster import load_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EX = os.path.join(ROOT, "examples")
RECIPES = {  # name: (recipe, cluster YAML, nodes, signal seconds, container image)
    "1node": ("llama3_8b_ppo.yaml", "llama3_8b_slurm.yaml", 1, 300, None),
    "16nodes": ("llama3_70b_ppo.yaml", "llama3_70b_slurm.yaml", 16, 600, "nvcr.io/nvidia/pytorch:25.01-py3"),
}


def _dryrun(name, backend, tmp_path, capsys):
    recipe, cluster, *_ = RECIPES[name]
    out = tmp_path / f"{name}-{backend}.sh"
    argv = ["submit", "ppo", f"examples/{recipe}", "--cluster", os.path.join(EX, cluster), "--backend", backend,
            "--dryrun", "--out", str(out), "ppo.iterations=7", "logging.run_dir=runs/a b"]
    if backend == "nemo-run":  # the real command; nemo-run's shell helper (invoke) needs a readable stdin
        proc = subprocess.run([sys.executable, "slurm/launch.py", *argv[1:]], cwd=ROOT, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, NEMORUN_HOME=str(tmp_path)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out.read_text()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the job runs from the checkout; configs are relative to it
    try:
        assert cli.main(argv) == 0, capsys.readouterr().err
    finally:
        os.chdir(cwd)
    return out.read_text()


def _flags(script):
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))


def _common(name, script):
    _, _, nodes, signal, image = RECIPES[name]
    flags = _flags(script)
    assert flags["nodes"] == str(nodes) and flags["ntasks-per-node"] == "1" and flags["gpus-per-node"] == "8"
    assert flags["signal"] == f"USR1@{signal}" and "requeue" in flags and flags["job-name"] == "megatron-rlhf-ppo"
    assert flags["account"] == "my_account" and flags["partition"] == "batch" and flags["open-mode"] == "append"
    assert "export GPUS_PER_NODE=8" in script and "export MASTER_PORT=29500" in script
    return flags, image


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_plain_script(name, tmp_path, capsys):
    script = _dryrun(name, "plain", tmp_path, capsys)
    flags, image = _common(name, script)
    assert flags["output"] == "logs/%x-%j.out"
    assert "export STAGE=ppo" in script and f"export CONFIG=examples/{RECIPES[name][0]}" in script
    assert "set -- ppo.iterations=7 'logging.run_dir=runs/a b'" in script  # overrides survive the shell
    assert ("export CONTAINER_IMAGE=" + image in script) if image else "CONTAINER_IMAGE=" not in script
    assert 'srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${CONTAINER[@]}" bash slurm/node.sh "$STAGE" "$CONFIG" "$@"' in script
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0  # valid shell


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_nemo_run_dryrun(name, tmp_path, capsys):
    if importlib.util.find_spec("nemo_run") is None:  # installed but failing to import is a failure, not a skip
        pytest.skip("nemo-run is the `slurm` extra: pip install -e '.[slurm]'")
    script = _dryrun(name, "nemo-run", tmp_path, capsys)
    flags, image = _common(name, script)
    srun = next(line for line in script.splitlines() if line.startswith("srun --output"))
    assert srun.endswith(f"bash {ROOT}/slurm/node.sh ppo examples/{RECIPES[name][0]} ppo.iterations=7 "
                         "'logging.run_dir=runs/a b'")
    assert "--kill-on-bad-exit=1" in srun
    if image:
        assert f"--container-image {image}" in srun and "/lustre/data:/data" in srun and f"{ROOT}:{ROOT}" in srun
    else:
        assert f"--chdir={ROOT}" in srun and "--container-image" not in srun


def test_nemo_run_passes_overrides_byte_for_byte(tmp_path, capsys):
    """nemo-run rewrites every "/nemo_run" of a non-container sbatch script (its job directory): the srun line
    of the dry run, run by bash, gives node.sh exactly the overrides the user typed."""
    if importlib.util.find_spec("nemo_run") is None:
        pytest.skip("nemo-run is the `slurm` extra: pip install -e '.[slurm]'")
    odd = ["logging.run_dir=/data/runs/nemo_run/a b $HOME=1 'q' \"dq\"", "ppo.iterations=7", "checkpoint.dir=/nemo_run"]
    out = tmp_path / "job.sh"
    proc = subprocess.run([sys.executable, "slurm/launch.py", "ppo", "examples/llama3_8b_ppo.yaml", "--cluster",
                           os.path.join(EX, "llama3_8b_slurm.yaml"), "--backend", "nemo-run", "--dryrun", "--out",
                           str(out), *odd], cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, NEMORUN_HOME=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    srun = next(line for line in out.read_text().splitlines() if line.startswith("srun --output"))
    words = srun.split(" bash ", 1)[1]  # node.sh's path and arguments, as the shell will read them
    echoed = subprocess.run(["bash", "-c", f"printf '%s\\n' {words}"], capture_output=True, text=True)
    assert echoed.stdout.splitlines() == [f"{ROOT}/slurm/node.sh", "ppo", "examples/llama3_8b_ppo.yaml", *odd]


def test_node_script_starts_one_launcher_with_the_nodes_ranks(tmp_path):
    """slurm/node.sh on node 3 of 16 runs `launch --nnodes 16 --node-rank 3 --nproc-per-node 8` (a stand-in python)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), ARGS_OUT=str(tmp_path / "args"), SLURM_JOB_NUM_NODES="16",
               SLURM_NODEID="3", GPUS_PER_NODE="8", MASTER_ADDR="node001", MASTER_PORT="29555",
               ENV_FILE="/nonexistent", SLURM_JOB_ID="")
    proc = subprocess.run(["bash", os.path.join(ROOT, "slurm", "node.sh"), "ppo", "r.yaml", "a=1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "args").read_text().split() == [
        "-m", "megatron_rlhf.cli", "launch", "--nnodes", "16", "--node-rank", "3", "--nproc-per-node", "8",
        "--master-addr", "node001", "--master-port", "29555", "ppo", "r.yaml", "a=1"]


class _FakeRank:
    def __init__(self, cmd, env):
        self.env, self.returncode = env, 0

    def poll(self):
        return 0


def test_launcher_gives_global_ranks_on_every_node(monkeypatch):
    started = []
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, env, **kw: started.append(_FakeRank(cmd, env)) or started[-1])
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)
    assert launch.main(["--nnodes", "16", "--node-rank", "3", "--nproc-per-node", "8", "--master-port", "29500",
                        "sft", "c.yaml"]) == 0
    assert [(int(r.env["RANK"]), int(r.env["LOCAL_RANK"])) for r in started] == [(24 + i, i) for i in range(8)]
    assert {r.env["WORLD_SIZE"] for r in started} == {"128"}
    with pytest.raises(SystemExit):
        launch.main(["--nnodes", "2", "--node-rank", "0", "sft", "c.yaml"])  # multi-node needs a fixed port


def test_cluster_yaml_errors_are_one_line(tmp_path):
    from megatron_rlhf.config.fields import ConfigError

    with pytest.raises(ConfigError, match="unknown config key 'gpu_per_node' .*did you mean 'gpus_per_node'"):
        load_cluster(os.path.join(EX, "llama3_8b_slurm.yaml"), ["gpu_per_node=4"])
    with pytest.raises(ConfigError, match="tunnel=ssh needs ssh_host"):
        load_cluster(None, ["tunnel=ssh"])
    assert load_cluster(os.path.join(EX, "llama3_70b_slurm.yaml"), ["nodes=32"]).world == 256
    with pytest.raises(ConfigError, match="gpus_per_node=0 .* needs ranks_per_node >= 1"):
        load_cluster(None, ["gpus_per_node=0"])
    assert load_cluster(None, ["nodes=2", "gpus_per_node=0", "ranks_per_node=3"]).world == 6
    with pytest.raises(ConfigError, match=r"time=2:00 \(120 s\) leaves no room for signal_seconds=100: .*at least"):
        load_cluster(None, ["time=2:00", "signal_seconds=100"])
    with pytest.raises(ConfigError, match="time='4h' is not a Slurm time limit"):
        load_cluster(None, ["time=4h"])
    with pytest.raises(ConfigError, match="time='-5' is not a Slurm time limit"):  # not 5 minutes
        load_cluster(None, ["time='-5'"])
    assert load_cluster(None, ["time=3:00", "signal_seconds=100"]).time == "3:00"


@pytest.mark.parametrize("value, seconds", [("90", 5400), ("2:30", 150), ("04:00:00", 14400), ("1-2", 93600),
                                            ("1-02:30", 95400), ("2-00:00:05", 172805), ("UNLIMITED", None)])
def test_slurm_time_limits_in_seconds(value, seconds):
    from megatron_rlhf.config.cluster import slurm_time_seconds

    assert slurm_time_seconds(value) == seconds


def test_a_clock_time_stays_as_written(tmp_path):
    """YAML 1.1 reads a plain `4:00:00` as the base-60 integer 14400, which Slurm would take as minutes."""
    path = tmp_path / "cluster.yaml"
    path.write_text("time: 4:00:00\nnodes: 2\n")
    assert load_cluster(str(path), []).time == "4:00:00"
    assert load_cluster(str(path), ["time=2:30:00"]).time == "2:30:00"
    assert load_cluster(None, ["time=240"]).time == "240"  # minutes, as Slurm reads it


def test_clock_times_in_yaml_lists_stay_as_written(tmp_path):
    from megatron_rlhf.config.io import _read_yaml

    path = tmp_path / "any.yaml"
    path.write_text("group:\n  times: [1, 2:30, '3:00']\n  steps:\n    - at: 1:00:00\n")
    assert _read_yaml(str(path)) == {"group": {"times": [1, "2:30", "3:00"], "steps": [{"at": "1:00:00"}]}}


def test_srun_only_environment_gives_rank_and_world(monkeypatch):
    """One task per GPU under plain srun (no launcher): rank, world size and local rank come from Slurm."""
    from megatron_rlhf.parallel.init import dist_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in dict(SLURM_PROCID="13", SLURM_NTASKS="16", SLURM_LOCALID="5", MASTER_ADDR="node001").items():
        monkeypatch.setenv(key, value)
    e = dist_env()  # reads os.environ, as the entry point does
    assert (e.rank, e.world_size, e.local_rank, e.master_addr) == (13, 16, 5, "node001")
