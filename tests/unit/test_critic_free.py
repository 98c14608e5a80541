"""The critic-free estimators (grpo, rloo, remax), the KL in the loss, and their config checks: no model needed."""

import pytest
import torch

from megatron_rlhf.config import schema as C
from megatron_rlhf.algo.advantages import group_advantages
from megatron_rlhf.algo.kl import k3
from megatron_rlhf.algo.losses import kl_penalty
from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.config.ppo import check_ppo_layout
from megatron_rlhf.trainer.ppo import critic_free as cf
from megatron_rlhf.trainer.ppo import models as ppo_models
from megatron_rlhf.trainer.ppo.eval import uniforms
from tests.unit.test_ppo_pieces import load

K = 4


def _groups(prompts, k=K, seed=0):
    """Rollouts of `prompts` ([n] token lists), k consecutive rows per prompt, with scores and logprobs."""
    g = torch.Generator().manual_seed(seed)
    rows = cf.group_rows(list(range(len(prompts))), k)
    T = 5
    lengths = torch.randint(1, T + 1, (len(rows),), generator=g)
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    gen = {"response_ids": torch.randint(3, 17, (len(rows), T), generator=g) * mask.long(), "response_mask": mask,
           "logprobs": torch.zeros(len(rows), T), "ended": torch.ones(len(rows), dtype=torch.bool), "lengths": lengths}
    exp = build_experience([prompts[i] for i in rows], gen, pad_id=0)
    exp.scores = torch.randn(len(rows), generator=g)
    exp.rm_scores = exp.scores.clone()
    exp.logprobs = -torch.rand(len(rows), T, generator=g) * mask
    exp.ref_logprobs = -torch.rand(len(rows), T, generator=g) * mask
    return exp


PROMPTS = [[1, 3, 5, 6], [1, 3, 7], [1, 3, 9, 9, 8], [1, 3, 5, 6, 4]]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_trainer_advantages_equal_group_advantages(estimator):
    exp = _groups(PROMPTS)
    cf.estimate_critic_free(exp, estimator, K, beta=0.1, kl_estimator="k1", kl_in="loss", whiten=False)
    direct = group_advantages(exp.scores, K, estimator)  # kl_in=loss: the reward is the score alone
    assert torch.equal(exp.advantages, direct.unsqueeze(1) * exp.response_mask)
    assert exp.values is None and exp.returns is None
    # kl_in=reward: the sequence reward is the score minus beta x the summed per-token KL
    exp = _groups(PROMPTS)
    cf.estimate_critic_free(exp, estimator, K, beta=0.1, kl_estimator="k3", kl_in="reward", whiten=False)
    shaped = exp.scores - 0.1 * (k3(exp.logprobs - exp.ref_logprobs) * exp.response_mask).sum(-1)
    torch.testing.assert_close(exp.advantages, group_advantages(shaped, K, estimator).unsqueeze(1) * exp.response_mask)
    assert not torch.allclose(shaped, exp.scores)


def test_remax_baseline_is_the_greedy_score():
    exp = _groups(PROMPTS, k=1)
    greedy = torch.tensor([0.5, -1.0, 0.2, 0.0])
    cf.estimate_critic_free(exp, "remax", 1, 0.0, "k1", "reward", whiten=False, baseline=greedy)
    assert torch.equal(exp.advantages, (exp.scores - greedy).unsqueeze(1) * exp.response_mask)
    stats = cf.group_stats(torch.tensor([0.5, 0.3, 0.2, 0.1]), 1, greedy)
    assert float(stats["group_flat_fraction"]) == 0.5  # prompts 0 and 2: sample and greedy scored alike


def test_group_stats_count_flat_groups_and_spread():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    s = cf.group_stats(scores, 4)
    assert float(s["group_flat_fraction"]) == 0.5
    assert float(s["group_reward_std"]) == pytest.approx(0.5 * torch.tensor([0.0, 1, 0, 1]).std().item())


def test_groups_survive_data_parallel_sharding():
    """Each rank samples all k responses of its own prompts (rows `group_rows` of its share); the rank-order
    concatenation (what all_gather_experience builds) is the global batch with every group whole, and the
    sampling draws of a rank's rows are the global draws of those rows, whatever the data-parallel size."""
    prompts_global, dp, T = list(range(8)), 2, 6
    total = len(prompts_global) * K
    gathered_rows, draws = [], []
    for rank in range(dp):
        mine = prompts_global[rank * 4:(rank + 1) * 4]
        rows = cf.group_rows(mine, K)
        gathered_rows += rows
        draws.append(uniforms(0, 3, slice(rank * len(rows), (rank + 1) * len(rows)), total, T))
    assert gathered_rows == cf.group_rows(prompts_global, K)
    assert torch.equal(torch.cat(draws), uniforms(0, 3, slice(0, total), total, T))
    # and the invariant the trainer checks every iteration holds on the gathered batch...
    whole = _groups(PROMPTS)
    cf.check_groups_whole(whole, K)
    # ...and fails when a group's members come from different prompts (a group split over ranks)
    split = whole.rows([0, 1, 2, 4, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
    with pytest.raises(RuntimeError, match="group 0 .* mixes prompts"):
        cf.check_groups_whole(split, K)


def test_kl_penalty_is_k3_sum_and_pulls_towards_the_reference():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    total, stats = kl_penalty(logp, ref, mask, "k3")
    r = torch.tensor([0.0, -0.5])
    assert float(total) == pytest.approx(float((torch.exp(-r) - 1 + r).sum()))
    total.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] < 0 and logp.grad[0, 2] == 0  # 0 at the reference, 0 on padding
    assert float(stats["tokens"]) == 2


def test_critic_free_modes_build_no_value_model(monkeypatch):
    built = []
    monkeypatch.setattr(ppo_models, "build_trainable", lambda cfg, ctx, head, *a, **k: built.append(("trained", head)) or
                        ppo_models.Trainable([torch.nn.Linear(1, 1)], None, None))
    monkeypatch.setattr(ppo_models, "build_frozen", lambda cfg, ctx, head, *a, **k: built.append(("frozen", head)) or
                        [torch.nn.Linear(1, 1)])
    for estimator, k, value_built in (("grpo", 4, False), ("rloo", 2, False), ("remax", 1, False), ("gae", 1, True)):
        built.clear()
        cfg = load(f"ppo.advantage_estimator={estimator}", f"ppo.samples_per_prompt={k}", "ppo.normalize_reward=false")
        m = ppo_models.build_ppo_models(cfg, ctx=None, total_steps=10)
        assert (("trained", "scalar") in built) == value_built, (estimator, built)
        assert (m.value is not None) == value_built
        assert set(m.trainables()) == ({"policy", "value"} if value_built else {"policy"})  # what checkpoints hold
        assert ("value" in m.forward_models()) == value_built


@pytest.mark.parametrize("overrides, message", [
    (["ppo.advantage_estimator=grpo"], "ppo.advantage_estimator=grpo needs ppo.samples_per_prompt >= 2 (got 1)"),
    (["ppo.samples_per_prompt=4"], "ppo.samples_per_prompt=4 is only for grpo/rloo"),
    (["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=3", "ppo.rollout_batch_size=10", "ppo.minibatch_size=8"],
     "10x3 rollouts must be a multiple of ppo.minibatch_size=8"),
    (["ppo.advantage_estimator=remax", "ppo.value_warmup_iterations=2"], "ppo.value_warmup_iterations=2 needs a value"),
    (["ppo.kl_in=loss"], "ppo.kl_in=loss with ppo.kl_estimator=k1"),
    (["ppo.kl_in=sideways"], "ppo.kl_in='sideways' is not one of"),
    (["ppo.advantage_estimator=ppo2"], "ppo.advantage_estimator='ppo2' is not one of"),
    (["ppo.ptx_coef=0.1"], "ppo.ptx_coef=0.1 needs ppo.ptx_data"),
    (["ppo.ptx_coef=0.1", "ppo.ptx_data=/no/such.jsonl"], "ppo.ptx_data: '/no/such.jsonl' not found"),
    (["ppo.ptx_coef=0.1", "ppo.ptx_data=/etc/hosts", "parallel.pp=2"], "ppo.ptx_coef=0.1 with parallel.pp=2"),
])
def test_bad_sibling_settings_fail_with_one_line(overrides, message):
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load(*overrides)
    assert "\n" not in str(e.value)


def test_prompts_must_split_over_ranks_for_whole_groups():
    cfg = load("ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=2", "ppo.rollout_batch_size=3",
               "ppo.minibatch_size=6", "train.micro_batch_size=3")
    check_ppo_layout(cfg, 1)
    with pytest.raises(C.ConfigError, match=r"ppo.rollout_batch_size=3 prompts do not split over 2 data-parallel"):
        check_ppo_layout(cfg, 2)
