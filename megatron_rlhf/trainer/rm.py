"""Stage 2, the Bradley-Terry reward model: the SFT backbone with a scalar head, trained on pairs.

A batch holds b chosen rows then b rejected rows (collate.collate_preference); the score of a
sequence is the head's output at its last real token.
"""

from __future__ import annotations

import torch

from megatron_rlhf.algo.losses import bradley_terry
from megatron_rlhf.models.heads import last_token_scores
from megatron_rlhf.trainer.calibration import calibrate
from megatron_rlhf.trainer.loop import Stage, run_stage


def rm_loss(output, batch):
    scores = last_token_scores(output, batch["lengths"])
    b = scores.shape[0] // 2
    loss_mean, accuracy = bradley_terry(scores[:b], scores[b:])
    n = torch.tensor(float(b))
    loss_sum = loss_mean * n
    return loss_sum, n, {
        "loss": (loss_sum.detach(), n),
        "accuracy": (accuracy * n, n),
        "score_margin": ((scores[:b] - scores[b:]).detach().sum(), n),
    }


def calibration_pass(cfg, chunks, tokenizer, dp_rank, dp_size, log):
    """Mean/std of this RM's scores on SFT-policy samples, stored as `reward_calibration`."""
    if not cfg.calibration.enabled:
        return {}
    stats = calibrate(cfg, chunks, tokenizer, dp_rank, dp_size, log)
    if log:
        log(f"reward calibration: mean {stats['mean']:.4f} std {stats['std']:.4f} over "
            f"{stats['num_samples']} SFT samples ({stats['ended_fraction']:.0%} ended with EOS)")
    return {"reward_calibration": stats}


STAGE = Stage(
    name="reward",
    data_kind="preference",
    head="scalar",
    loss_fn=rm_loss,
    stat_names=["accuracy", "loss", "score_margin"],
    init_source=("policy", "reward"),  # model.load: an SFT policy (a fresh head), or a reward model to go on from
    finalize=calibration_pass,
)


def run(cfg):
    """`megatron-rlhf rm`: returns held-out metrics (loss, accuracy, score_margin)."""
    return run_stage(cfg, STAGE)
