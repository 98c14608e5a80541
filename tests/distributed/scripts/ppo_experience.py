"""PPO experience for a fixed batch of generated tokens vs a plain per-sequence recomputation.

Usage: torchrun --nproc_per_node N ppo_experience.py OUT.json TP

Four tiny random models (policy, reference, value, reward; vocab 17, padded to 18 at TP=2). A fixed
generation result: left-padded prompts of different lengths, some responses cut at max length (no
EOS), some ended by EOS. The trainer's path (batch.build_experience -> experience.score_and_recompute
-> estimate_advantages without whitening) is compared with a loop in this script that feeds ONE
sequence at a time, without any padding, through each model and reads the outputs by hand.
Also: with the reference holding the policy's weights, logprobs equal reference logprobs exactly.
"""

import json
import sys

import torch

from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.ppo.experience import Frozen, estimate_advantages, score_and_recompute

VOCAB, PAD, EOS, T = 17, 0, 2, 6
BETA, TEMP, MEAN, STD, PENALTY = 0.1, 0.8, 0.3, 1.7, 1.0
CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=VOCAB, max_position_embeddings=32, init_method_std=0.2)


def fixed_batch():
    """Prompts (token lists of different lengths) and a generation dict as a RolloutEngine returns it."""
    g = torch.Generator().manual_seed(1)
    prompt_lengths = [5, 2, 7, 3, 1]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in prompt_lengths]
    # response lengths: EOS at the end of rows 0, 2, 4; rows 1 and 3 cut at T without EOS
    lengths = [3, T, 1, T, 4]
    ended = [True, False, True, False, True]
    ids = torch.full((5, T), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        if ended[i]:
            ids[i, n - 1] = EOS
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    gen = {"response_ids": ids, "response_mask": mask, "logprobs": torch.zeros(5, T),
           "ended": torch.tensor(ended), "lengths": torch.tensor(lengths)}
    return prompts, gen


def full_logits(model, seq):
    """One unpadded sequence [n] -> full-vocab logits [n, V_true] (TP shards gathered)."""
    from megatron.core import parallel_state as ps

    ids = torch.tensor([seq])
    out = model[0](ids, torch.arange(len(seq)).unsqueeze(0), None)[0]  # [n, V/tp]
    if ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out[:, :VOCAB].float()


@torch.no_grad()
def reference_loop(models, prompts, gen):
    """Plain recomputation, one sequence at a time, no padding anywhere."""
    rows = []
    for i, prompt in enumerate(prompts):
        n = int(gen["lengths"][i])
        response = gen["response_ids"][i, :n].tolist()
        seq = prompt + response
        p = len(prompt)
        lp, ref = [], []
        for name, out in (("policy", lp), ("reference", ref)):
            logp = torch.log_softmax(full_logits(models[name], seq) / TEMP, dim=-1)
            out += [float(logp[p + k - 1, response[k]]) for k in range(n)]
        v = models["value"][0](torch.tensor([seq]), torch.arange(len(seq)).unsqueeze(0), None)[0, :, 0]
        values = [float(v[p + k - 1]) for k in range(n)]
        r = models["reward"][0](torch.tensor([seq]), torch.arange(len(seq)).unsqueeze(0), None)[0, -1, 0]
        score = (float(r) - MEAN) / STD if bool(gen["ended"][i]) else -PENALTY
        rewards = [-BETA * (lp[k] - ref[k]) for k in range(n)]
        rewards[-1] += score
        rows.append({"logprobs": lp, "ref_logprobs": ref, "values": values, "score": score, "rewards": rewards})
    return rows


def main():
    out_path, tp = sys.argv[1], int(sys.argv[2])
    parallel = ParallelConfig(tp=tp)
    init.initialize(parallel, seed=5)
    models = {}
    for seed, (name, head) in enumerate([("policy", "lm"), ("reference", "lm"), ("value", "scalar"), ("reward", "scalar")]):
        torch.manual_seed(100 + seed)
        models[name] = build_model(CFG, parallel, head=head)
        if head == "scalar":  # a zero head would make the check vacuous
            torch.nn.init.normal_(models[name][0].output_layer.weight, std=0.5)
    prompts, gen = fixed_batch()
    frozen = Frozen(VOCAB, TEMP, MEAN, STD, PENALTY)
    exp = build_experience(prompts, gen, PAD)
    score_and_recompute(exp, models, frozen, micro_batch_size=2)
    estimate_advantages(exp, BETA, "k1", gamma=1.0, lam=0.95, whiten=False)
    expected = reference_loop(models, prompts, gen)

    diffs = {"logprobs": 0.0, "ref_logprobs": 0.0, "values": 0.0, "score": 0.0, "rewards": 0.0, "padding": 0.0}
    for i, row in enumerate(expected):
        n = len(row["logprobs"])
        for key in ("logprobs", "ref_logprobs", "values", "rewards"):
            got = getattr(exp, key)[i]
            diffs[key] = max(diffs[key], (got[:n] - torch.tensor(row[key])).abs().max().item())
            diffs["padding"] = max(diffs["padding"], got[n:].abs().max().item() if n < T else 0.0)
        diffs["score"] = max(diffs["score"], abs(float(exp.scores[i]) - row["score"]))

    # The reference with the policy's own weights: exactly equal logprobs, KL exactly 0.
    same = dict(models, reference=models["policy"])
    exp2 = score_and_recompute(build_experience(prompts, gen, PAD), same, frozen, micro_batch_size=3)
    result = {
        "diffs": diffs,
        "kl_max_abs": (exp.logprobs - exp.ref_logprobs).abs().max().item(),
        "same_weights_equal": bool(torch.equal(exp2.logprobs, exp2.ref_logprobs)),
        "truncated_scores": [float(exp.scores[i]) for i in (1, 3)],
        "ended": exp.ended.tolist(),
    }
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    init.destroy()


if __name__ == "__main__":
    main()
