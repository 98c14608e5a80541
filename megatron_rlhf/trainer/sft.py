"""Stage 1, supervised fine-tuning: token cross-entropy on response tokens (prompt tokens masked)."""

from __future__ import annotations

from megatron_rlhf.trainer.loop import Stage, run_stage


def sft_loss(output, batch):
    """output: per-token CE [b, s] from GPTModel (labels given); returns (sum, tokens, stats)."""
    mask = batch["loss_mask"]
    loss_sum = (output.float() * mask).sum()
    n = mask.sum()
    return loss_sum, n, {"loss": (loss_sum.detach(), n)}


STAGE = Stage(
    name="policy",
    data_kind="sft",
    head="lm",
    loss_fn=sft_loss,
    stat_names=["loss"],
    model_kwargs=lambda batch: {"labels": batch["labels"]},
)


def run(cfg):
    """`megatron-rlhf sft`: returns the final held-out metrics (empty without an eval split)."""
    return run_stage(cfg, STAGE)
