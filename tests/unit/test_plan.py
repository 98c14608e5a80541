"""`megatron-rlhf plan`: bytes per GPU against hand computation (ppo-spec.md's 7B rule of thumb, both
Llama-3 recipes), bad layouts, the verdict with its suggestion, --json, and launch.py's refusal."""

import json
import os

import pytest

from megatron_rlhf import cli
from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.parallel.layout import LayoutError
from megatron_rlhf.plan.cli import load_for_plan
from megatron_rlhf.plan.memory import state_bytes_per_param
from megatron_rlhf.plan.planner import GIB, Cluster, plan_stage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EX = os.path.join(ROOT, "examples")
R8, R70 = os.path.join(EX, "llama3_8b_ppo.yaml"), os.path.join(EX, "llama3_70b_ppo.yaml")
R70_8 = os.path.join(EX, "llama3_70b_ppo_8b_rm.yaml")
DPO8, SFT8 = os.path.join(EX, "llama3_8b_dpo.yaml"), os.path.join(EX, "llama3_8b_sft.yaml")
C8, C70 = os.path.join(EX, "llama3_8b_slurm.yaml"), os.path.join(EX, "llama3_70b_slurm.yaml")
LLAMA2_7B = ["model.num_layers=32", "model.hidden_size=4096", "model.ffn_hidden_size=11008",
             "model.num_attention_heads=32", "model.num_query_groups=32", "model.vocab_size=32000",
             "model.params_dtype=bfloat16", "ppo.rollout_batch_size=8", "ppo.minibatch_size=8",
             "train.micro_batch_size=1", "data.max_seq_len=512", "ppo.max_new_tokens=512"]


def test_rule_of_thumb_7b_times_4_models_is_252_gb():
    trained = sum(state_bytes_per_param("bfloat16", True, grad_fp32=False))
    frozen = sum(state_bytes_per_param("bfloat16", False))
    assert (trained, frozen) == (16, 2)
    assert 7e9 * (2 * trained + 2 * frozen) == 252e9
    # This code reduces gradients in an fp32 buffer (trainer/optim.py): 18 bytes per trained parameter.
    assert sum(state_bytes_per_param("bfloat16", True)) == 18
    # The distributed optimizer shards the 12 bytes of fp32 master weights + Adam moments over DP.
    assert state_bytes_per_param("bfloat16", True, dp=4, distributed_optimizer=True) == (2, 4, 3)


def test_planner_7b_example_by_hand():
    """Llama-2-7B, four models on one GPU, no sharding: state = P*18*2 + P*2*2 (value/RM: scalar head)."""
    cfg = load_for_plan("ppo", None, LLAMA2_7B)
    plan = plan_stage(cfg, "ppo", Cluster(nodes=1, gpus_per_node=1, gpu_memory_gib=1000))
    p_lm = 2 * 32000 * 4096 + 32 * (2 * 4096 + 4 * 4096 * 4096 + 3 * 4096 * 11008) + 4096
    p_scalar = p_lm - 32000 * 4096 + 4096
    models = {m.name: m for m in plan.models}
    assert [models[n].params_per_gpu for n in ("policy", "value", "reference", "reward")] == [p_lm, p_scalar] * 2
    assert (models["policy"].weights, models["policy"].gradients, models["policy"].optimizer) == (2 * p_lm, 4 * p_lm, 12 * p_lm)
    assert models["reference"].state == 2 * p_lm and models["reference"].gradients == 0
    assert plan.state == 18 * (p_lm + p_scalar) + 2 * (p_lm + p_scalar)
    assert 250e9 < plan.state < 252e9 * 18 / 16  # between the rule (16 B) and 18 B per trained parameter
    # KV cache of 8 prompts x 1024 tokens: 2 (K, V) x 32 layers x 32 heads x 128 x 2 bytes per token.
    assert models["policy"].kv_cache == 2 * 32 * 32 * 128 * 2 * 8 * 1024
    assert plan.fits and plan.total == plan.state + max(plan.phases.values())
    # Rollout in the training layout: gradients and optimizer state of policy and value wait in host memory.
    value = models["value"]
    assert plan.phases["rollout"] == models["policy"].kv_cache - (16 * p_lm + value.gradients + value.optimizer)
    # ppo.reference_mode=swap: no reference weights on the GPU (host copies run in the policy's model).
    swapped = plan_stage(load_for_plan("ppo", None, LLAMA2_7B + ["ppo.reference_mode=swap"]), "ppo",
                         Cluster(nodes=1, gpus_per_node=1, gpu_memory_gib=1000))
    assert swapped.state == plan.state - 2 * p_lm
    assert {m.name: m for m in swapped.models}["reference"].weights == 0


def test_cpu_partition_counts_host_memory_as_the_ranks():
    """On CPU ranks the moves to host memory free nothing (rollout/offload.py is a no-op there): the rollout
    keeps gradients and optimizer state, ppo.offload_frozen and reference swap keep their weights in the
    rank's memory, and neither is suggested. The reserve is the interpreter's, not a CUDA context's."""
    cpu, gpu = Cluster(nodes=1, gpus_per_node=1, gpu_memory_gib=1000, cpu=True), Cluster(1, 1, 1000)
    plan = plan_stage(load_for_plan("ppo", None, LLAMA2_7B), "ppo", cpu)
    models = {m.name: m for m in plan.models}
    assert plan.phases["rollout"] == models["policy"].kv_cache
    for extra in (["ppo.offload_frozen=true"], ["ppo.reference_mode=swap"]):
        cfg = load_for_plan("ppo", None, LLAMA2_7B + extra)
        assert plan_stage(cfg, "ppo", cpu).total == plan.total
        assert plan_stage(cfg, "ppo", gpu).total < plan_stage(load_for_plan("ppo", None, LLAMA2_7B), "ppo", gpu).total
    # 250 GiB: on GPUs the frozen models' offload is the change that fits; on CPU ranks no single change does.
    cfg = load_for_plan("ppo", None, LLAMA2_7B)
    assert plan_stage(cfg, "ppo", Cluster(1, 1, 250)).suggestion == "ppo.offload_frozen=true"
    suggestion = plan_stage(cfg, "ppo", Cluster(1, 1, 250, reserve_gib=4.0, cpu=True)).suggestion
    assert suggestion == "no single change fits: combine more TP/PP, recompute and more nodes"
    from megatron_rlhf.config.cluster import SlurmCluster

    assert Cluster.of(SlurmCluster(nodes=2, gpus_per_node=0, ranks_per_node=4, gpu_memory_gib=12)).reserve_gib == 1.0
    assert Cluster.of(SlurmCluster(nodes=2, gpus_per_node=8, gpu_memory_gib=80)).reserve_gib == 4.0


def _plan(recipe, cluster, *overrides):
    from megatron_rlhf.plan.cli import cluster_from_yaml

    cfg = load_for_plan("ppo", recipe, list(overrides))
    return plan_stage(cfg, "ppo", cluster_from_yaml(cluster))


def test_llama3_8b_recipe_by_hand():
    """TP=4, PP=1 on 8 GPUs: per GPU 1/4 of every sharded tensor; DP=2 shards the optimizer; FP8 caches 2 B/param."""
    plan = _plan(R8, C8)
    h, f, kv, v, tp = 4096, 14336, 8 * 128, 128512, 4  # vocab 128256 padded to a multiple of 128 * 4
    layer = 2 * h + h * (h + 2 * kv) // tp + h * h // tp + 3 * h * f // tp
    policy = v * h // tp + 32 * layer + h + v * h // tp
    m = {x.name: x for x in plan.models}
    assert m["policy"].params_per_gpu == policy
    assert m["policy"].weights == policy * (2 + 2) and m["policy"].gradients == policy * 4
    assert m["policy"].optimizer == policy * 12 / 2
    assert m["reference"].weights == policy * 2
    assert plan.world == 8 and plan.dp == 2 and plan.fits
    assert plan.total < 76 * GIB
    # It generates on the training weights (rollout.tp=4, no SP); with sequence parallelism a decode step cannot
    # split its one token, so generation needs a copy of its own.
    assert m["policy"].generation_weights == 0
    sp = {x.name: x for x in _plan(R8, C8, "parallel.sequence_parallel=true").models}
    assert sp["policy"].generation_weights == policy * 2


def test_llama3_70b_recipe_by_hand():
    """TP=8 x PP=4 x VPP=5 on 128 GPUs: the first rank holds 5 chunks of 4 layers + the embedding."""
    plan = _plan(R70, C70)
    h, f, kv, v, tp = 8192, 28672, 8 * 128, 129024, 8  # vocab 128256 padded to a multiple of 128 * 8
    layer = 2 * h + h * (h + 2 * kv) // tp + h * h // tp + 3 * h * f // tp
    first = v * h // tp + 20 * layer
    last = 20 * layer + h + v * h // tp
    m = {x.name: x for x in plan.models}
    assert m["policy"].params_per_gpu == max(first, last)
    assert m["policy"].optimizer == max(first, last) * 12 / 4
    assert not m["reference"].resident and not m["reward"].resident  # ppo.offload_frozen
    assert plan.world == 128 and plan.dp == 4 and plan.fits
    # The recipe generates at rollout.tp=8 (PP=1) and scores at ppo.inference_tp=8 (PP=1).
    assert m["reference"].layout.startswith("TP=8 PP=1") and m["reward"].layout.startswith("TP=8 PP=1")
    assert not any("rollout.tp" in n for n in plan.notes)
    # Without a generation layout a pipelined policy would generate through its pipeline: the plan says so.
    assert any("rollout.tp" in n for n in _plan(R70, C70, "rollout.tp=null").notes)
    # Generating from a copy (TP=8, PP=1): the training weights wait in host memory too, unless told to stay.
    p, val = m["policy"], m["value"]
    in_host = p.gradients + p.optimizer + val.gradients + val.optimizer
    assert p.generation_weights == (v * h // tp + 80 * layer + h + v * h // tp) * 2  # bf16, all 80 layers
    assert plan.phases["rollout"] == p.kv_cache + p.generation_weights - in_host - p.weights
    kept = _plan(R70, C70, "rollout.release_training_weights=false")
    assert kept.phases["rollout"] == plan.phases["rollout"] + p.weights


def test_a_70b_policy_with_an_8b_reward_model_and_critic_counts_each_model_with_its_own_size():
    """Issue 45 item 5: the 8B reward model's architecture from ppo.reward_hf_config (its checkpoint lives on the
    cluster), the critic from it; the critic trains at the policy's TP=8 x PP=4 x VPP=4 (8 layers per stage), the
    reward model scores at its own TP=2."""
    plan = _plan(R70_8, C70)
    m = {x.name: x for x in plan.models}
    h, f, kv, v = 4096, 14336, 8 * 128, 128256  # Llama-3-8B; a scalar head has no vocabulary projection
    layer = lambda tp: 2 * h + h * (h + 2 * kv) // tp + h * h // tp + 3 * h * f // tp  # noqa: E731
    padded = 128256  # a multiple of 128 * 2
    assert m["value"].layout.startswith("TP=8 PP=4 VPP=4")
    assert m["value"].params_per_gpu == max(129024 * h // 8 + 8 * layer(8), 8 * layer(8) + h + h)
    assert m["reward"].layout.startswith("TP=2 PP=1")
    assert m["reward"].params_per_gpu == padded * h // 2 + 32 * layer(2) + h + h
    assert m["reference"].params_per_gpu == _plan(R70, C70).models[2].params_per_gpu  # the 70B reference stays
    assert m["policy"].params_per_gpu > 7 * m["value"].params_per_gpu  # 70.6B against 7.5B in one layout
    assert plan.fits and plan.total < _plan(R70, C70).total


def test_llama3_8b_dpo_recipe_by_hand():
    """DPO: the policy trains on 2 x micro_batch_size rows (the SFT recipe's activations at twice its micro
    batch), beside a frozen bf16 reference in the same layout: resident with online log-probs, else alone
    before the policy is built; the sampled evaluation adds a KV cache, and the reference again if it was freed."""
    from megatron_rlhf.plan.cli import cluster_from_yaml
    from megatron_rlhf.plan.memory import kv_cache_bytes

    def plan(recipe, stage, *overrides):
        return plan_stage(load_for_plan(stage, recipe, list(overrides)), stage, cluster_from_yaml(C8))

    h, f, kv, v, tp = 4096, 14336, 8 * 128, 128256, 2
    layer = 2 * h + h * (h + 2 * kv) // tp + h * h // tp + 3 * h * f // tp
    params = v * h // tp + 32 * layer + h + v * h // tp
    pre = plan(DPO8, "dpo")
    m = {x.name: x for x in pre.models}
    assert pre.world == 8 and pre.dp == 4 and pre.fits and set(m) == {"policy", "reference"}
    assert m["policy"].params_per_gpu == m["reference"].params_per_gpu == params
    assert m["policy"].weights == params * (2 + 2) and m["policy"].optimizer == params * 12 / 4
    assert m["reference"].weights == params * 2 and m["reference"].gradients == m["reference"].optimizer == 0
    sft = plan(SFT8, "sft", "train.micro_batch_size=4")
    assert m["policy"].activations == sft.models[0].activations == pre.phases["train"]
    assert not m["reference"].resident and pre.state == m["policy"].state == sft.state
    assert pre.state + pre.phases["reference_logprobs"] == m["reference"].weights + m["reference"].activations
    online = plan(DPO8, "dpo", "dpo.reference_logprobs=online")
    assert online.state == pre.state + m["reference"].weights
    assert online.phases["reference_logprobs"] == m["reference"].activations
    # 256 held-out prompts over DP=4 in one batch of 64, 1024 prompt + 64 new tokens, 4 KV heads per GPU
    sampled = plan(DPO8, "dpo", "dpo.eval_prompts_path=/data/prompts.jsonl", "parallel.sequence_parallel=false")
    arch = load_for_plan("dpo", DPO8, []).model.to_model_config()
    assert sampled.phases["eval"] == m["reference"].weights + kv_cache_bytes(arch, 2, 64, 1088)
    assert kv_cache_bytes(arch, 2, 64, 1088) == 2 * 32 * 4 * 128 * 2 * 64 * 1088
    online_sampled = plan(DPO8, "dpo", "dpo.eval_prompts_path=/data/prompts.jsonl", "parallel.sequence_parallel=false",
                          "dpo.reference_logprobs=online")  # the resident reference is the one evaluated
    assert online_sampled.phases["eval"] == kv_cache_bytes(arch, 2, 64, 1088)
    # online log-probs that do not fit: precomputing them is the first suggestion
    tight = plan_stage(load_for_plan("dpo", DPO8, ["dpo.reference_logprobs=online"]), "dpo",
                       Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=(pre.total + online.total) / 2 / GIB + 4))
    assert not tight.fits and tight.suggestion == "dpo.reference_logprobs=precompute"
    small = plan_stage(load_for_plan("dpo", DPO8, []), "dpo", Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=8))
    assert small.suggestion == "no single change fits: combine more TP/PP, recompute and more nodes"  # DPO's levers


@pytest.mark.parametrize("overrides, error, fragment", [
    (["parallel.pp=3"], LayoutError, "world size 128 is not divisible by tp*pp*cp = 8*3*1 = 24"),
    (["parallel.tp=16", "parallel.pp=2"], LayoutError, "model.num_query_groups (key/value heads)=8 is not divisible by parallel.tp=16"),
    (["parallel.vpp=3"], LayoutError, "model.num_layers=80 is not divisible by pp*vpp = 4*3 = 12"),
    (["parallel.recompute=some"], LayoutError, "parallel.recompute='some' is not one of"),
    (["ppo.minibatch_size=66"], ConfigError, "ppo.minibatch_size=66 is not divisible by data-parallel size * train.micro_batch_size = 4*1"),
    # The PPO stage's own start-up checks (config/ppo.py check_ppo_layout): what the run refuses, the plan refuses.
    (["ppo.rollout_batch_size=522"], ConfigError, "ppo.rollout_batch_size=522 prompts do not split over 4 data-parallel ranks"),
    (["parallel.cp=2"], ConfigError, "the PPO stage supports tp (with sequence parallelism), pp (and vpp) and dp"),
    (["rollout.tp=3"], ConfigError, "rollout.tp=3 does not divide the world size 128"),
])
def test_bad_layouts_give_one_line(overrides, error, fragment):
    with pytest.raises(error) as e:
        _plan(R70, C70, *overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_dpo_refuses_what_its_stage_refuses():
    """The DPO stage's own layout check (config/dpo.py check_dpo_layout): its sampled evaluation needs PP=1."""
    cfg = load_for_plan("dpo", DPO8, ["dpo.eval_prompts_path=/data/prompts.jsonl", "parallel.pp=2",
                                      "parallel.sequence_parallel=false"])
    with pytest.raises(ConfigError, match="^dpo.eval_prompts_path samples with the Megatron sampler, which needs "
                                          "parallel.pp=1"):
        plan_stage(cfg, "dpo", Cluster())


def test_cli_verdict_suggestion_and_json(capsys):
    assert cli.main(["plan", R8, "--cluster", C8]) == 0
    out = capsys.readouterr().out
    assert "fits: peak" in out and "largest term" in out
    # TP=2 does not fit one node; the planner names the smallest change that does.
    assert cli.main(["plan", R8, "--cluster", C8, "parallel.tp=2"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: peak" in out and "smallest change that fits: parallel.tp=4" in out
    assert cli.main(["plan", R70, "--cluster", C70, "--json", "--nodes", "8"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["world"] == 64 and set(doc["models"]) == {"policy", "value", "reference", "reward"}
    assert isinstance(doc["fits"], bool) and doc["total_bytes_per_gpu"] > doc["state_bytes_per_gpu"] > 0
    assert cli.main(["plan", R70, "--cluster", C70, "parallel.tp=3"]) == 2
    assert capsys.readouterr().err.startswith("error: world size 128 is not divisible")
    # Without --cluster or --nodes the refusal says which cluster it assumed and how to name the recipe's.
    assert cli.main(["plan", R70]) == 2
    assert capsys.readouterr().err == (
        "error: world size 8 is not divisible by tp*pp*cp = 8*4*1 = 32: change parallel.tp/pp/cp or the number of "
        "ranks (planned for the default 1 node x 8 GPUs: pass --cluster CLUSTER.yaml, or --nodes and "
        "--gpus-per-node)\n")


def test_dpo_is_planned_and_submitted(capsys, tmp_path):
    """`plan` takes a DPO recipe's stage from its dpo group; `submit dpo` plans it and writes its job."""
    assert cli.main(["plan", DPO8, "--cluster", C8]) == 0
    assert capsys.readouterr().out.startswith("plan: dpo on 8 GPUs (DP=4)")
    out = tmp_path / "dpo.sbatch"
    cwd = os.getcwd()
    os.chdir(ROOT)  # the job runs from the checkout; configs are relative to it
    try:
        assert cli.main(["submit", "dpo", "examples/llama3_8b_dpo.yaml", "--cluster", C8, "--dryrun", "--out",
                         str(out), "train.train_steps=7"]) == 0
    finally:
        os.chdir(cwd)
    assert "plan: dpo on 8 GPUs" in capsys.readouterr().err
    script = out.read_text()
    assert "#SBATCH --job-name=megatron-rlhf-dpo" in script and "export STAGE=dpo" in script
    assert "export CONFIG=examples/llama3_8b_dpo.yaml" in script and "train.train_steps=7" in script


def test_submit_refuses_what_does_not_fit_unless_forced(capsys, tmp_path):
    argv = ["submit", "ppo", R8, "--cluster", C8, "--dryrun", "parallel.tp=2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: the planner says ppo does not fit" in err and "try parallel.tp=4, or pass --force" in err
    assert cli.main(argv + ["--force", "--out", str(tmp_path / "job.sh")]) == 0
    assert "#SBATCH --nodes=1" in (tmp_path / "job.sh").read_text()


def test_cpu_partition_is_planned_per_rank(capsys, tmp_path):
    """A CPU partition's cluster YAML (gpus_per_node 0, ranks_per_node N; docs/scale-out.md's local cluster)
    plans nodes x ranks_per_node ranks, as `submit` does, and says what its memory figure stands for."""
    yaml = tmp_path / "local.yaml"
    yaml.write_text("nodes: 2\ngpus_per_node: 0\nranks_per_node: 1\ngpu_memory_gib: 12\n")
    tiny = os.path.join(ROOT, "examples", "tiny", "sft.yaml")
    assert cli.main(["plan", tiny, "--cluster", str(yaml)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: sft on 2 CPU ranks (DP=2), GiB per CPU rank\n") and "params/rank" in out
    assert "of 11.0 GiB usable" in out
    assert "note: a CPU partition: each rank is planned with gpu_memory_gib (12 GiB" in out
    assert cli.main(["plan", tiny, "--cluster", str(yaml), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dp"] == 2 and doc["device"] == "CPU rank"
    assert cli.main(["plan", tiny, "--gpus-per-node", "0"]) == 2
    assert capsys.readouterr().err == (
        "error: --nodes 1 and --gpus-per-node 0 must be >= 1 (a CPU partition: pass --cluster with its YAML, whose "
        "ranks_per_node the planner counts)\n")


def test_a_phase_that_frees_a_few_bytes_shows_zero(capsys):
    """The tiny PPO's rollout frees its gradients and optimizer state (a few hundred KB): 0.0 GiB, not -0.0."""
    assert cli.main(["plan", os.path.join(EX, "tiny", "ppo.yaml"), "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "rollout 0.0," in out and "-0.0" not in out, out
