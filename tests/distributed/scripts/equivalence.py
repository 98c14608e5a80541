"""3 optimizer steps of an LM and a value model on a fixed batch; writes per-step losses (rank 0).

Usage: torchrun --nproc_per_node N equivalence.py OUT.json INIT_DIR save|load TP PP DISTOPT [VPP [SEQUENCE_PARALLEL]]
The global batch is identical for every layout; DP ranks take disjoint halves of it. Initial
weights come from one place: the single-rank reference run saves them as a Megatron distributed
checkpoint (`save`), the parallel runs load them resharded to their layout (`load`).
"""

import json
import os
import sys

import torch

from megatron_rlhf.models.build import build_model
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.parallel import init
from megatron_rlhf.parallel.layout import ParallelConfig, validate_layout
from megatron_rlhf.config.schema import TrainConfig
from megatron_rlhf.trainer.optim import build_optimizer, wrap_ddp
from megatron_rlhf.trainer.step import make_forward_step, train_step

GLOBAL_BATCH, MICRO, SEQ, VOCAB = 8, 2, 12, 64


def global_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    # Ragged loss masks so microbatches hold different token counts (tests global normalisation).
    lengths = torch.randint(3, SEQ + 1, (GLOBAL_BATCH,), generator=g)
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).float()
    labels = torch.roll(ids, -1, dims=1)
    targets = torch.randn(GLOBAL_BATCH, SEQ, generator=g)
    return ids, labels, mask, targets


def lm_loss(output, batch):
    # GPTModel returns per-token cross-entropy [b, s] when labels are given (vocab-parallel CE).
    mask = batch["loss_mask"]
    loss_sum = (output.float() * mask).sum()
    n = mask.sum()
    return loss_sum, n, {"loss": (loss_sum.detach(), n)}


def value_loss(output, batch):
    mask = batch["loss_mask"]
    err = (output.squeeze(-1).float() - batch["targets"]) ** 2 * mask
    loss_sum = 0.5 * err.sum()
    n = mask.sum()
    return loss_sum, n, {"loss": (loss_sum.detach(), n)}


def share_initial_weights(chunks, path, mode):
    """Save (reference run) or load (parallel runs) the initial weights, resharded by megatron."""
    from megatron.core import dist_checkpointing

    state = {f"chunk{i}": c.sharded_state_dict(prefix="") for i, c in enumerate(chunks)}
    if mode == "save":
        os.makedirs(path, exist_ok=True)
        dist_checkpointing.save(state, path)
    else:
        loaded = dist_checkpointing.load(state, path)
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[f"chunk{i}"])


def main():
    out, init_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    tp, pp, distopt = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    vpp = int(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[7] != "0" else None
    sequence_parallel = len(sys.argv) > 8 and sys.argv[8] == "1"
    parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp, use_distributed_optimizer=distopt,
                              sequence_parallel=sequence_parallel)
    model_cfg = ModelConfig(
        num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        vocab_size=VOCAB, max_position_embeddings=64,
    )
    validate_layout(parallel, init.world_size_from_env(), num_layers=4, num_attention_heads=4, num_query_groups=2)
    init.initialize(parallel, seed=7)
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ids, labels, mask, targets = global_batch()
    per_rank = GLOBAL_BATCH // dp
    sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    microbatches = [
        {"input_ids": ids[sl][i : i + MICRO], "labels": labels[sl][i : i + MICRO],
         "loss_mask": mask[sl][i : i + MICRO], "targets": targets[sl][i : i + MICRO]}
        for i in range(0, per_rank, MICRO)
    ]
    results = {}
    for head, loss_fn, kwargs in (
        ("lm", lm_loss, lambda b: {"labels": b["labels"]}),
        ("scalar", value_loss, None),
    ):
        torch.manual_seed(7)
        chunks = build_model(model_cfg, parallel, head=head)
        # (pp rank, tp rank, parameters on this rank) of every rank: the planner's counts are checked against it.
        mine = [ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                sum(p.numel() for c in chunks for p in c.parameters())]
        counts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(counts, mine)
        results[f"params_{head}"] = counts
        share_initial_weights(chunks, os.path.join(init_dir, head), mode)
        chunks = wrap_ddp(chunks, distopt)
        # A tight clip so that clipping is active and its CPU path is exercised.
        train = TrainConfig(lr=1e-2, clip_grad=0.5, lr_schedule="constant")
        optimizer, scheduler = build_optimizer(chunks, train, distopt, total_steps=3)
        fwd = make_forward_step(loss_fn, kwargs)
        results[head] = [train_step(chunks, optimizer, scheduler, microbatches, fwd) for _ in range(3)]
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    init.destroy()


if __name__ == "__main__":
    main()
