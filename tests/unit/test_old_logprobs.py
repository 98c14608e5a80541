"""ppo.old_logprobs: `sampler` takes PPO's pi_old from the generation engine's log-probs (no policy forward),
`recompute` runs the policy; the config refuses `sampler` where those log-probs are not the policy's
(truncated sampling) or where the rollout correction would compare them with themselves."""

import pytest
import torch

from megatron_rlhf.config import schema as C
from megatron_rlhf.trainer.ppo import experience
from megatron_rlhf.trainer.ppo.batch import Experience

BASE = ["data.train_path=/etc/hosts", "tokenizer.path=/tmp", "model.load=/tmp", "ppo.reward_load=/tmp",
        "data.max_prompt_len=16", "model.max_position_embeddings=128"]


def _experience():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return Experience(input_ids=torch.ones(2, 5, dtype=torch.long), prompt_lengths=torch.tensor([2, 2]),
                      response_ids=torch.ones(2, 3, dtype=torch.long), response_mask=mask,
                      ended=torch.tensor([True, False]),
                      sampler_logprobs=torch.tensor([[-0.5, -1.0, -7.0], [-0.25, -2.0, -3.0]]))


@pytest.mark.parametrize("mode", ["recompute", "sampler"])
def test_which_model_gives_the_old_logprobs(monkeypatch, mode):
    forwards = []

    def collect_logprobs(chunks, mbs, vocab_size, temperature):
        forwards.append(chunks)
        return [torch.full((2, 3), -4.0 if chunks == "policy" else -6.0)]

    monkeypatch.setattr(experience, "collect_logprobs", collect_logprobs)
    monkeypatch.setattr(experience, "score_responses", lambda *a: (torch.zeros(2), torch.zeros(2)))
    monkeypatch.setattr(experience, "forward_collect", lambda *a: [torch.zeros(2, 3)])
    models = {"policy": "policy", "reference": "reference", "reward": "reward", "value": "value"}
    exp = experience.score_and_recompute(_experience(), models, experience.Frozen(8, 1.0), 2, old_logprobs=mode)
    mask = exp.response_mask
    if mode == "sampler":
        assert forwards == ["reference"]  # no policy forward
        assert torch.equal(exp.logprobs, exp.sampler_logprobs * mask)
        assert exp.logprobs.data_ptr() != exp.sampler_logprobs.data_ptr()
    else:
        assert forwards == ["policy", "reference"]
        assert torch.equal(exp.logprobs, torch.full((2, 3), -4.0) * mask)
    assert torch.equal(exp.ref_logprobs, torch.full((2, 3), -6.0) * mask)


@pytest.mark.parametrize("extra,culprit", [
    (["ppo.top_k=5"], "ppo.top_k=5"),
    (["ppo.top_p=0.9"], "ppo.top_p=0.9"),
    (["ppo.rollout_correction=tis"], "ppo.rollout_correction=tis"),
])
def test_sampler_logprobs_that_are_not_the_policys_are_refused(extra, culprit):
    with pytest.raises(C.ConfigError, match="ppo.old_logprobs=sampler") as e:
        C.load_config(C.PPOConfig, None, [*BASE, "ppo.old_logprobs=sampler", *extra])
    assert culprit in str(e.value) and "\n" not in str(e.value)
    assert C.load_config(C.PPOConfig, None, [*BASE, "ppo.old_logprobs=sampler"]).ppo.old_logprobs == "sampler"
    assert C.load_config(C.PPOConfig, None, BASE).ppo.old_logprobs == "recompute"
