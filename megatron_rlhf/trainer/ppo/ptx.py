"""PPO-ptx (InstructGPT): each policy update also descends ptx_coef x the LM loss on a batch of SFT-format text.

The batch (`ppo.minibatch_size` rows of `ppo.ptx_data`) is cut from one global, resumable cursor that
every rank keeps (the whole dataset is loaded on each rank; it is only text), and each data-parallel
rank trains its contiguous share. Its micro-batches run in the same Megatron schedule as the policy
minibatch, so one optimizer step sees both losses. The schedule divides every gradient by the policy
minibatch's global token count N_pol (per-token loss normalisation, trainer/optim.py); a ptx micro-batch
therefore contributes 0 tokens and its token-sum loss scaled by ptx_coef x N_pol / N_ptx, which makes
the step's objective  L_policy + ptx_coef x mean LM loss over the ptx batch's N_ptx tokens.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_rlhf.data import dataset as D
from megatron_rlhf.data.sampler import ShardedBatchSampler
from megatron_rlhf.data.collate import collate_sft, microbatches
from megatron_rlhf.models import packing
from megatron_rlhf.trainer.ppo.experience import tp_group

Batch = Dict[str, torch.Tensor]


class PtxBatches:
    """Global batches of SFT examples; `next_share()` -> this rank's micro-batches and the global token count."""

    def __init__(self, dataset, batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, pad_id: int,
                 seed: int = 0, max_tokens: Optional[int] = None):
        self.dataset, self.batch_size, self.micro_batch_size = dataset, batch_size, micro_batch_size
        self.max_tokens = max_tokens  # train.max_tokens_per_micro_batch
        self.dp_rank, self.dp_size, self.pad_id = dp_rank, dp_size, pad_id
        # One global cursor (dp_size=1 view): every rank sees every index, so the token count needs no collective.
        self.sampler = ShardedBatchSampler(len(dataset), batch_size, 0, 1, seed=seed, key="ppo.minibatch_size")

    @classmethod
    def load(cls, cfg, tokenizer, dp_rank: int, dp_size: int, log=None) -> "PtxBatches":
        dataset, _ = D.load_examples("sft", cfg.data, tokenizer, cfg.ppo.ptx_data, log)
        return cls(dataset, cfg.ppo.minibatch_size, cfg.train.micro_batch_size, dp_rank, dp_size,
                   tokenizer.pad_token_id, seed=cfg.data.seed or 0, max_tokens=cfg.train.max_tokens_per_micro_batch)

    def next_share(self) -> Tuple[List[Batch], int]:
        """(this rank's collated micro-batches, LM-loss tokens of the whole global batch)."""
        indices = next(self.sampler)
        share = self.batch_size // self.dp_size
        mine = indices[self.dp_rank * share: (self.dp_rank + 1) * share]
        masks = self.dataset[[int(i) for i in indices]]["loss_mask"]
        tokens = int(sum(sum(m[1:]) for m in masks))  # collate_sft shifts the mask by one (next-token targets)
        mbs = microbatches(self.dataset, mine, self.micro_batch_size, collate_sft, max_tokens=self.max_tokens,
                           packed=packing.enabled(), pad_id=self.pad_id, multiple_of=packing.sequence_multiple())
        return mbs, tokens

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def ptx_loss(logits: torch.Tensor, mb: Batch, vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """Vocab-parallel logits [b, S, V/tp] of an SFT micro-batch -> (scaled token-sum LM loss, 0 tokens, stats).

    mb["ptx_scale"] (0-dim) = ptx_coef x N_pol / N_ptx (module docstring); stats["ptx_loss"] is the
    unscaled LM loss sum over this micro-batch's tokens, with their count."""
    from megatron_rlhf.models.logprobs import token_logprobs

    mask = mb["loss_mask"]
    logp = token_logprobs(logits, mb["labels"], tp_group(), vocab_size)
    loss_sum = -(logp * mask).sum()
    return loss_sum * mb["ptx_scale"], torch.zeros((), dtype=torch.int), {"ptx_loss": (loss_sum.detach(), mask.sum())}


def with_scale(microbatches: List[Batch], coef: float, policy_tokens: float, ptx_tokens: int) -> List[Batch]:
    """The ptx micro-batches with their loss scale ptx_coef x N_pol / N_ptx attached."""
    scale = torch.tensor(coef * policy_tokens / max(ptx_tokens, 1), dtype=torch.float32)
    return [{**mb, "ptx_scale": scale} for mb in microbatches]
