"""Packed against padded micro-batches in one layout, on the same weights (models/packing.py).

Usage: torchrun --nproc_per_node N packing.py OUT.json TP PP SEQUENCE_PARALLEL(0|1)

A PPO experience of long-tailed lengths (prompts 1-9 tokens, responses 1-20) through the trainer's passes, each
run padded and packed: the policy's log-probs (PPO's old log-probs), values and reward scores (forward only),
then one forward-backward of the PPO policy loss and of the value loss (losses and every local gradient, before
the optimizer would step). Micro-batches are cut once (2 rows each) and fed to both, so only the layout of each
forward differs. The leak test: new tokens in one sequence, packed, change that sequence's log-probs and values
and no other's (bit for bit). Rank 0 writes the largest differences, relative to each quantity's largest
magnitude (at least 1): fp32 rounds a softmax sum over a padded row, zeros included, in another order.
"""

import json
import sys

import torch

from megatron_rlhf.models import packing
from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.trainer.ppo.batch import build_experience
from megatron_rlhf.trainer.ppo.experience import (collect_logprobs, forward_collect, last_token_scores,
                                                  response_rows, response_values, scoring_rows)
from megatron_rlhf.trainer.ppo.learn import policy_loss_fn, value_loss_fn
from megatron_rlhf.trainer.step import make_forward_step, reduce_stats, run_schedule

VOCAB, PAD, ROWS, T = 29, 0, 8, 20
CFG = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=VOCAB, max_position_embeddings=64)  # the default init (std 0.02)


def experience(changed_row=None):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(1, 10, (ROWS,), generator=g)]
    lengths = torch.tensor([1, 20, 3, 2, 14, 5, 1, 9])  # long-tailed: most short, a few long
    ids = torch.randint(1, VOCAB, (ROWS, T), generator=g)
    if changed_row is not None:
        ids[changed_row] = torch.randint(1, VOCAB, (T,), generator=torch.Generator().manual_seed(11))
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    gen = {"response_ids": (ids * mask).long(), "response_mask": mask, "logprobs": -torch.rand(ROWS, T, generator=g),
           "ended": lengths < T, "lengths": lengths}
    exp = build_experience(prompts, gen, PAD)
    exp.advantages = torch.randn(ROWS, T, generator=g) * mask
    exp.returns = torch.randn(ROWS, T, generator=g) * mask
    return exp


def passes(models, exp, packed: bool):
    """(old log-probs [B, T], values [B, T], scores [B], losses, local gradients) with packing on or off."""
    packing.configure(False)
    mbs = exp.microbatches(2)  # one cut for both
    packing.configure(packed, packing_multiple())
    out = {"logprobs": torch.cat(collect_logprobs(models["policy"], mbs, VOCAB, 1.0)) * exp.response_mask,
           "values": torch.cat(forward_collect(models["value"], mbs, response_values)) * exp.response_mask,
           "scores": torch.cat(forward_collect(models["reward"], [scoring_rows(mb) for mb in mbs], last_token_scores))}
    if exp.logprobs is None:  # the learning passes' micro-batches carry PPO's old log-probs and values
        return out
    steps = {"policy": make_forward_step(policy_loss_fn(VOCAB, 1.0, 0.2, 0.0, {}), rows=response_rows),
             "value": make_forward_step(value_loss_fn(0.2, 1.0))}
    for name, step in steps.items():
        for p in (p for c in models[name] for p in c.parameters()):
            p.grad = None
        stats = reduce_stats(run_schedule(models[name], mbs, step))
        sum_sequence_parallel_grads(models[name])
        out[f"{name}_loss"] = stats[f"{name}_loss"]
        out[f"{name}_grads"] = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(models[name])
                                for n, p in c.named_parameters() if p.grad is not None}
    packing.configure(False)
    return out


def sum_sequence_parallel_grads(chunks):
    """Under sequence parallelism a norm weight's gradient on a TP rank covers its slice of the sequence only;
    Megatron's finalize_model_grads (which the trainer runs, on its DDP-wrapped models) sums the weights marked
    `sequence_parallel` over the TP group. The same sum here, on these bare models."""
    from megatron.core import parallel_state as ps

    if not SEQUENCE_PARALLEL:
        return
    for p in (p for c in chunks for p in c.parameters()):
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def packing_multiple():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if SEQUENCE_PARALLEL else 1


def main():
    global SEQUENCE_PARALLEL
    out_path, tp, pp, SEQUENCE_PARALLEL = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    parallel = ParallelConfig(tp=tp, pp=pp, sequence_parallel=SEQUENCE_PARALLEL)
    init.initialize(parallel, seed=5)
    models = {}
    for seed, (name, head) in enumerate([("policy", "lm"), ("value", "scalar"), ("reward", "scalar")]):
        torch.manual_seed(100 + seed)
        models[name] = build_model(CFG, parallel, head=head)
        for c in models[name]:
            if head == "scalar" and c.post_process:  # a zero head would make the checks vacuous
                torch.nn.init.normal_(c.output_layer.weight, std=0.5)
    exp = experience()
    first = passes(models, exp, packed=False)
    exp.logprobs, exp.values = first["logprobs"], first["values"]
    padded, packed = passes(models, exp, packed=False), passes(models, exp, packed=True)
    result = {"padding_fraction": 1 - float(exp.sequence_lengths.sum()) / (ROWS * exp.input_ids.shape[1])}
    for key in ("logprobs", "values", "scores"):  # relative to the quantity's scale (values reach ~10 here)
        result[key] = float((packed[key] - padded[key]).abs().max() / padded[key].abs().max().clamp(min=1.0))
    for name in ("policy", "value"):
        result[f"{name}_loss"] = abs(packed[f"{name}_loss"] - padded[f"{name}_loss"]) / max(1.0, abs(padded[f"{name}_loss"]))
        grads = padded[f"{name}_grads"]
        assert grads and set(grads) == set(packed[f"{name}_grads"])
        result[f"{name}_grad_rel"] = max(float((packed[f"{name}_grads"][k] - g).norm() / g.norm().clamp(min=1e-30))
                                         for k, g in grads.items())  # per parameter: |difference| / |gradient|
        result[f"{name}_grad_nonzero"] = all(float(g.abs().max()) > 0 for g in grads.values())
    changed = experience(changed_row=4)
    leak = passes(models, changed, packed=True)
    same = [i for i in range(ROWS) if i != 4]
    result["leak_others_equal"] = all(torch.equal(leak[k][same], packed[k][same]) for k in ("logprobs", "values"))
    result["leak_changed_differs"] = not torch.equal(leak["logprobs"][4], packed["logprobs"][4])
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    init.destroy()


if __name__ == "__main__":
    main()
