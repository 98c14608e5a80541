"""PPO-ptx on one rank (in process): the ptx micro-batches do not disturb the PPO part of a step (ptx_coef=0 gives
the same weights as plain PPO, bit for bit), and with ptx_coef > 0 the LM loss on the ptx text falls."""

import torch

from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.ppo.experience import forward_collect, response_logprobs
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.ppo.learn import SkipGuard, learn
from megatron_rlhf.trainer.ppo.ptx import PtxBatches
from megatron_rlhf.trainer.run import Trainable
from tests.unit.test_ppo_pieces import load

VOCAB = 17
CFG = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=VOCAB, max_position_embeddings=32)
SETTINGS = ["ppo.rollout_batch_size=8", "ppo.minibatch_size=8", "ppo.epochs=1", "train.micro_batch_size=4",
            "train.lr=3e-3", "train.lr_schedule=constant", "ppo.max_new_tokens=4"]


def _policy(cfg):
    torch.manual_seed(0)
    chunks = wrap_ddp(build_model(CFG, ParallelConfig()), False, check_for_nan_in_grad=False)
    optimizer, scheduler = build_optimizer(chunks, cfg.train, False, total_steps=100)
    return Trainable(chunks, optimizer, scheduler)


def _rollouts(policy):
    """8 fixed prompt+response rows with the policy's own logprobs as the old ones and random advantages."""
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 3] + torch.randint(7, 17, (3,), generator=g).tolist() for _ in range(8)]
    lengths = torch.tensor([4, 3, 2, 4, 1, 4, 3, 2])
    mask = (torch.arange(4) < lengths.unsqueeze(1)).float()
    gen = {"response_ids": torch.randint(7, 17, (8, 4), generator=g) * mask.long(), "response_mask": mask,
           "logprobs": torch.zeros(8, 4), "ended": torch.ones(8, dtype=torch.bool), "lengths": lengths}
    exp = build_experience(prompts, gen, pad_id=0)
    exp.logprobs = torch.cat(forward_collect(policy.chunks, exp.microbatches(4),
                                             lambda o, mb: response_logprobs(o, mb, VOCAB, 1.0))) * mask
    exp.advantages = torch.randn(8, 4, generator=g) * mask
    return exp


def _ptx_batches(cfg):
    from datasets import Dataset

    g = torch.Generator().manual_seed(2)
    rows = []
    for _ in range(64):  # "sort"-like text: the prompt part unmasked, the answer part trained on
        ids = [1, 3] + torch.randint(7, 17, (4,), generator=g).tolist() + [5, 6, 7, 2]
        rows.append({"input_ids": ids, "loss_mask": [0] * 6 + [1] * 4})
    return PtxBatches(Dataset.from_list(rows), cfg.ppo.minibatch_size, cfg.train.micro_batch_size, 0, 1, pad_id=0)


def _learn(policy, exp, cfg, ptx, iteration=0):
    return learn(policy, None, exp, cfg, iteration=iteration, dp_rank=0, dp_size=1, vocab_size=VOCAB,
                 train_policy=True, guard=SkipGuard(3), steps_done={"policy": 0, "value": 0}, ptx=ptx)


def _weights(policy):
    return [p.detach().clone() for p in policy.chunks[0].parameters()]


def test_ptx_coef_zero_is_plain_ppo_and_ptx_loss_falls(world):  # world: tests/unit/conftest.py
    cfg = load(*SETTINGS, "ppo.ptx_coef=0")
    plain = _policy(cfg)
    exp = _rollouts(plain)
    plain_stats = _learn(plain, exp, cfg, None)
    zero = _policy(cfg)
    zero_stats = _learn(zero, exp, cfg, _ptx_batches(cfg))  # ptx micro-batches in the step, scaled by 0
    for a, b in zip(_weights(plain), _weights(zero)):
        assert torch.equal(a, b)
    assert {k: v for k, v in zero_stats.items() if k != "ptx_loss"} == plain_stats
    assert zero_stats["ptx_loss"] > 0

    cfg = load(*SETTINGS, "ppo.ptx_coef=1.0", "ppo.ptx_data=/etc/hosts")  # the rows come from _ptx_batches
    mixed, ptx = _policy(cfg), _ptx_batches(cfg)
    losses = [_learn(mixed, exp, cfg, ptx, iteration=i)["ptx_loss"] for i in range(8)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert any(not torch.equal(a, b) for a, b in zip(_weights(mixed), _weights(zero)))


def test_ptx_cursor_resumes_and_counts_global_tokens():
    cfg = load(*SETTINGS)
    straight = _ptx_batches(cfg)
    for _ in range(3):
        straight.next_share()
    resumed = _ptx_batches(cfg)
    resumed.load_state_dict(straight.state_dict())
    a, tokens = straight.next_share()
    b, _ = resumed.next_share()
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert tokens == 8 * 4  # 8 rows x 4 answer tokens: the global count, from every rank's view
    half = PtxBatches(straight.dataset, 8, 4, 1, 2, pad_id=0)  # rank 1 of 2 trains rows 4..7 of the same batch
    half.load_state_dict(straight.state_dict())
    straight_next, _ = straight.next_share()
    mine, tokens_half = half.next_share()
    assert torch.equal(mine[0]["input_ids"], straight_next[1]["input_ids"]) and tokens_half == tokens
