"""DPO (`megatron-rlhf dpo`): the policy trained on preference pairs against a frozen reference.

One more stage on the shared loop (trainer/loop.py), like SFT and the reward model: same data
format as the RM (a batch holds b chosen rows then b rejected rows, data.collate_preference), an LM
head, and a loss on per-sequence log-probabilities of the responses:

    logp(y | x) = sum over response tokens t of log pi(y_t | x, y_<t)        [2b] per batch
    loss        = algo.losses.dpo_loss(logp_w, logp_l, ref_w, ref_l, beta, label_smoothing)

The reference (the SFT weights of `model.load`, or `dpo.reference_load`; no DDP, optimizer or gradients)
gives ref_w, ref_l:
`dpo.reference_logprobs=precompute` computes them for every pair of the train and eval sets once,
before the policy is built (each data-parallel rank a contiguous share; one all-reduce makes the
[N, 2] table whole on every rank), then frees the reference; `online` keeps the reference and runs
its forward on each batch. Both attach `ref_logps` [2b] to the micro-batches (Stage.prepare).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import torch

from megatron_rlhf.algo.losses import dpo_loss
from megatron_rlhf.data.sampler import eval_batches
from megatron_rlhf.data.collate import collate_preference, microbatches
from megatron_rlhf.models import packing
from megatron_rlhf.models.logprobs import token_logprobs
from megatron_rlhf.trainer.loop import Stage, run_stage

Batch = Dict[str, torch.Tensor]
STATS = ["chosen_logp", "chosen_reward", "loss", "rejected_logp", "rejected_reward", "reward_accuracy",
         "reward_margin"]


def response_mask(batch: Batch) -> torch.Tensor:
    """[2b, s] float: 1.0 at positions whose logits predict a response token (prompt_len - 1 ..
    length - 2), for a preference batch (rows [0, b) chosen, [b, 2b) rejected, same prompts)."""
    ids, lengths = batch["input_ids"], batch["lengths"]
    prompt = batch["prompt_lens"].repeat(2)
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return ((pos >= (prompt - 1).unsqueeze(1)) & (pos <= (lengths - 2).unsqueeze(1))).float()


def sequence_logprobs(logits: torch.Tensor, batch: Batch, vocab_size: int, tp_group=None) -> torch.Tensor:
    """Vocab-parallel logits [2b, s, V/tp] -> [2b] summed log-probs of each row's response (>= fp32)."""
    ids = batch["input_ids"]
    labels = torch.roll(ids, -1, dims=1)  # label at t is token t+1; the wrapped last column is masked
    logp = token_logprobs(logits, labels, tp_group, vocab_size)
    mask = response_mask(batch).to(logp.device)
    return torch.where(mask > 0, logp, torch.zeros_like(logp)).sum(-1)


def dpo_batch_loss(logits: torch.Tensor, batch: Batch, *, vocab_size: int, beta: float, label_smoothing: float,
                   tp_group=None):
    """The stage's loss: (sum of per-pair DPO losses, pairs, stats as (sum, count)); `batch["ref_logps"]` [2b]."""
    logps = sequence_logprobs(logits, batch, vocab_size, tp_group)
    ref = batch["ref_logps"].to(logps)
    b = logps.shape[0] // 2
    loss_mean, st = dpo_loss(logps[:b], logps[b:], ref[:b], ref[b:], beta, label_smoothing)
    n = torch.tensor(float(b))
    loss_sum = loss_mean * n
    lw, ll = logps[:b].detach(), logps[b:].detach()
    return loss_sum, n, {
        "loss": (loss_sum.detach(), n),
        "reward_accuracy": (st["accuracy"] * n, n),
        "reward_margin": ((st["chosen_reward"] - st["rejected_reward"]) * n, n),
        "chosen_reward": (st["chosen_reward"] * n, n),
        "rejected_reward": (st["rejected_reward"] * n, n),
        "chosen_logp": (lw.sum(), n),
        "rejected_logp": (ll.sum(), n),
    }


def _stage_loss(output, batch, **kw):
    from megatron_rlhf.trainer.ppo.experience import tp_group

    return dpo_batch_loss(output, batch, tp_group=tp_group(), **kw)


# --------------------------------------------------------------------------- the frozen reference


def build_reference(cfg, tokenizer) -> List[torch.nn.Module]:
    """The reference's weights (`dpo.reference_load`, else the SFT weights of `model.load`) in the training
    layout, frozen (eval mode, no grad, no DDP). Before training (`prepare`) and again for the evaluation
    after it when `precompute` freed it (trainer/dpo/eval.py)."""
    from megatron_rlhf.checkpoint import state as ckpt
    from megatron_rlhf.config.stage_models import other_models
    from megatron_rlhf.trainer.ppo.models import freeze
    from megatron_rlhf.trainer.run import expected_tokenizer

    [reference] = other_models(cfg)  # dpo.reference_load or model.load, with the architecture its checkpoint records
    return freeze(ckpt.load_model(reference.path, reference.arch, cfg.parallel, "policy", "lm", fp8=cfg.fp8,
                                  key=reference.key, tokenizer=expected_tokenizer(cfg, tokenizer)))


def reference_logps(reference, mbs: List[Batch], vocab_size: int) -> List[torch.Tensor]:
    """Forward-only pass of the reference: one [2b] tensor per micro-batch, on every pipeline rank."""
    from megatron_rlhf.trainer.ppo.experience import forward_collect, tp_group

    return forward_collect(reference, mbs, lambda out, mb: sequence_logprobs(out, mb, vocab_size, tp_group()))


def precompute_table(reference, dataset, cfg, tokenizer, pad_to, vocab_size: int) -> torch.Tensor:
    """[N, 2] (chosen, rejected) reference logprobs of every pair of `dataset`, identical on every rank.

    Each data-parallel rank computes a contiguous share (data/sampler.py eval_batches); a SUM all-reduce of the
    zero-filled tables over the data-parallel group assembles it (each entry has one non-zero term)."""
    from megatron.core import parallel_state as ps

    table = torch.zeros(len(dataset), 2, dtype=torch.float32)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mbs_size = cfg.train.micro_batch_size
    for indices in eval_batches(len(dataset), cfg.train.global_batch_size, dp_rank, dp_size):
        for start in range(0, len(indices), mbs_size):
            part = indices[start: start + mbs_size]
            # One micro-batch per schedule call: a shorter tail keeps pipeline shapes consistent.
            mbs = microbatches(dataset, part, len(part), collate_preference, pad_id=tokenizer.pad_token_id,
                               pad_to=pad_to, multiple_of=packing.sequence_multiple())
            (logps,) = reference_logps(reference, mbs, vocab_size)
            table[part] = logps.float().view(2, -1).t()
    if dp_size > 1:
        torch.distributed.all_reduce(table, group=ps.get_data_parallel_group())
    return table


def prepare(cfg, ctx, splits, pad_to, kept: Optional[dict] = None) -> Callable:
    """Stage.prepare: the reference, then `attach(split, mbs, indices)` adding `ref_logps` [2b] per micro-batch.
    A reference that stays for the run (`online`) is also put in `kept["reference"]`, for the evaluation."""
    vocab, log = ctx.model_cfg.vocab_size, ctx.log
    reference = build_reference(cfg, ctx.tokenizer)
    if cfg.dpo.reference_logprobs == "online":
        if kept is not None:
            kept["reference"] = reference
        def attach_online(split: str, mbs: List[Batch], indices) -> List[Batch]:
            for mb, logps in zip(mbs, reference_logps(reference, mbs, vocab)):
                mb["ref_logps"] = logps
            return mbs

        return attach_online

    tables = {"train": precompute_table(reference, splits.train, cfg, ctx.tokenizer, pad_to, vocab)}
    if splits.eval is not None:
        tables["eval"] = precompute_table(reference, splits.eval, cfg, ctx.tokenizer, pad_to, vocab)
    del reference  # not needed again: training runs without its weights in memory
    if log:
        log("dpo: reference logprobs of " + ", ".join(f"{len(t)} {k}" for k, t in tables.items())
            + " pairs computed; reference freed")

    def attach_table(split: str, mbs: List[Batch], indices) -> List[Batch]:
        table, start = tables[split], 0
        for mb in mbs:
            b = mb["prompt_lens"].shape[0]
            rows = torch.as_tensor([int(i) for i in indices[start: start + b]], dtype=torch.long)
            mb["ref_logps"] = torch.cat([table[rows, 0], table[rows, 1]])
            start += b
        return mbs

    return attach_table


def dpo_stage(cfg) -> Stage:
    from megatron_rlhf.trainer.dpo.eval import summary_pass

    d = cfg.dpo
    kept: dict = {}  # the online reference, shared by prepare and the evaluation after the last step
    return Stage(
        name="policy",  # a DPO checkpoint is a policy: PPO, convert and tiny-pairs read it as one
        data_kind="preference",
        head="lm",
        loss_fn=functools.partial(_stage_loss, vocab_size=cfg.model.vocab_size, beta=d.beta,
                                  label_smoothing=d.label_smoothing),
        stat_names=STATS,
        init_source="policy",
        finalize=functools.partial(summary_pass, kept=kept, build_reference=build_reference),
        prepare=functools.partial(prepare, kept=kept),
    )


def run(cfg):
    """`megatron-rlhf dpo`: returns the held-out pair metrics (loss, reward_accuracy, reward_margin, ...)."""
    return run_stage(cfg, dpo_stage(cfg))
