"""ppo.reference_mode=swap (trainer/ppo/reference_swap.py): the reference weights kept in host memory and
swapped into the policy give the separate reference model's logprobs, and the policy gets its own
weights back to the bit."""

import pytest
import torch

from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.ppo.experience import forward_collect, response_logprobs
from megatron_rlhf.trainer.optim import wrap_ddp
from megatron_rlhf.trainer.ppo.reference_swap import HostReference

VOCAB = 61
CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=VOCAB, max_position_embeddings=64, init_method_std=0.2)


def _microbatches():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (4, 2, 6, 3)]
    lengths = torch.tensor([5, 3, 1, 4])
    gen = {"response_ids": torch.randint(1, VOCAB, (4, 5), generator=g),
           "response_mask": (torch.arange(5) < lengths.unsqueeze(1)).float(),
           "logprobs": torch.zeros(4, 5), "ended": torch.tensor([False, True, True, True]), "lengths": lengths}
    return build_experience(prompts, gen, pad_id=0).microbatches(2)


def _logprobs(models, mbs):
    return torch.cat(forward_collect(models, mbs, lambda o, mb: response_logprobs(o, mb, VOCAB, 1.0)))


def _params(chunks):
    return {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}


@pytest.mark.parametrize("distributed_optimizer", [False, True])  # True: parameters are views of DDP's buffer
def test_swapped_reference_matches_the_separate_model_and_restores_the_policy(world, distributed_optimizer):
    torch.manual_seed(0)
    (initial,) = build_model(CFG, ParallelConfig())
    (separate,) = build_model(CFG, ParallelConfig())  # the separate reference: the same initial weights
    separate.load_state_dict(initial.state_dict())
    policy = wrap_ddp([initial], distributed_optimizer)
    reference = HostReference(policy)  # taken as build_ppo_models does: the policy as loaded
    assert list(reference) == []  # nothing for the frozen-model movers to move
    with torch.no_grad():  # training moved the policy away from the reference
        for p in policy[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = _params(policy)
    mbs = _microbatches()

    swapped = _logprobs(reference, mbs)
    expected = _logprobs([separate], mbs)
    own = _logprobs(policy, mbs)

    assert torch.equal(swapped, expected)
    assert (own - expected).abs().max() > 1e-3  # the comparison is not vacuous: the policy differs
    after = _params(policy)
    assert all(torch.equal(before[n], after[n]) for n in before), "the policy's weights were not restored"
    assert torch.equal(_logprobs(reference, mbs), expected)  # and a second swap still holds the reference


def test_swap_refuses_nesting_and_a_changed_model(world):
    torch.manual_seed(0)
    (model,) = build_model(CFG, ParallelConfig())
    reference = HostReference([model])
    with reference.swapped():
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with reference.swapped():
                pass
    reference.host[0] = reference.host[0][:1]
    with pytest.raises(RuntimeError, match="reference copy"):
        with reference.swapped():
            pass
