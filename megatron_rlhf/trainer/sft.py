"""Stage 1, supervised fine-tuning: token cross-entropy on response tokens (prompt tokens masked).

The loss is computed from the vocab-parallel logits over the TRUE vocabulary: Megatron pads the
vocabulary to a multiple of `make_vocab_size_divisible_by * tp`, and a padded id taking softmax mass
would make the loss depend on the TP size (and a run resumed under another layout jump).
"""

from __future__ import annotations

import functools

from megatron_rlhf.models.logprobs import token_logprobs
from megatron_rlhf.trainer.loop import Stage, run_stage


def sft_loss(output, batch, vocab_size: int):
    """output: logits [b, s, V_padded / tp] (vocab-parallel); batch labels/loss_mask [b, s].

    Returns (sum of -log p(label) over masked tokens, token count, stats); padded ids get p = 0.
    """
    from megatron.core import parallel_state as ps

    logp = token_logprobs(output, batch["labels"], tp_group=ps.get_tensor_model_parallel_group(),
                          vocab_size=vocab_size)
    mask = batch["loss_mask"]
    loss_sum = -(logp * mask).sum()
    n = mask.sum()
    return loss_sum, n, {"loss": (loss_sum.detach(), n)}


def sft_stage(vocab_size: int) -> Stage:
    """The SFT stage for a model whose true (unpadded) vocabulary has `vocab_size` ids."""
    return Stage(
        name="policy",
        data_kind="sft",
        head="lm",
        loss_fn=functools.partial(sft_loss, vocab_size=vocab_size),
        stat_names=["loss"],
    )


def run(cfg):
    """`megatron-rlhf sft`: returns the final held-out metrics (empty without an eval split)."""
    return run_stage(cfg, sft_stage(cfg.model.vocab_size))
