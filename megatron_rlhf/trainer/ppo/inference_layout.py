"""Frozen reference and reward models in an inference layout (`ppo.inference_tp`, and the reward model's own
`ppo.reward_inference_tp`: TP = that, PP = 1, DP = world / TP), apart from the training layout.

The models are built with their own process groups (rollout/layout.py's `tp_only_layout`) and filled
from their distributed checkpoints, resharded at load: no training-layout copy is ever built.
Scoring moves rows as generation does (rollout/redistribute.py): the rollouts of all training DP
shares are gathered in training DP order, split over inference DP ranks, run forward (no pipeline
schedule: PP = 1), and each rank takes back the results for its own share. So `score_and_recompute`
sees the same [b, T] log-probs and [b] scores as from a training-layout model.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_rlhf.models import heads, packing
from megatron_rlhf.models.logprobs import token_logprobs
from megatron_rlhf.parallel.device import on_device_of
from megatron_rlhf.rollout import redistribute as R
from megatron_rlhf.rollout.layout import Layout, build_in_layout, run_in_layout

ROW_KEYS = ("input_ids", "lengths", "prompt_lengths", "response_ids", "response_mask")  # what an lm head reads
SCORE_KEYS = ("input_ids", "lengths")  # what a scalar head reads (experience.scoring_rows)


class InferenceModel:
    """A frozen model in a tp-only layout. `collect_rows(microbatches)` is what `experience.py` asks of it:
    lm head -> log-probs [b, T] of the response tokens; scalar head -> score [b] at the last real token of
    scoring rows ({input_ids, lengths}, experience.scoring_rows)."""

    def __init__(self, model: torch.nn.Module, layout: Layout, head: str, vocab_size: int, temperature: float):
        self.model, self.layout, self.head = model.eval(), layout, head
        self.vocab_size, self.temperature = vocab_size, temperature

    def __iter__(self):  # a list of one chunk to the helpers that move frozen models (models.resident)
        return iter([self.model])

    def collect_rows(self, microbatches: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
        """This rank's training-share micro-batches (Experience.microbatches) -> results for their rows."""
        size = microbatches[0]["input_ids"].shape[0]

        def forward(part: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            n = part["input_ids"].shape[0]
            with torch.no_grad():
                return {"out": torch.cat([self._forward(R.take(part, torch.arange(s, min(s + size, n))))
                                          for s in range(0, n, size)])}

        keys = ROW_KEYS if self.head == "lm" else SCORE_KEYS
        out = run_in_layout(self.layout, _concat_rows([{k: mb[k] for k in keys} for mb in microbatches]),
                            _concat_rows, forward)["out"]
        return out.to(microbatches[0]["input_ids"].device)

    def _forward(self, mb: Dict[str, torch.Tensor]) -> torch.Tensor:
        from megatron_rlhf.trainer.ppo.experience import per_response_token, response_rows
        from megatron_rlhf.trainer.step import model_forward

        if self.head == "scalar":  # its own widest row, whatever the rows gathered beside it on other ranks
            mb["input_ids"] = mb["input_ids"][:, : int(mb["lengths"].max())]
        mb = on_device_of(self.model, mb)
        width = packing.packed_width(mb["lengths"], self.layout.tp)
        if packing.enabled() and packing.worth_packing(mb["input_ids"].numel(), width):  # as the training layout packs
            mb["pack_width"] = width
        ids = mb["input_ids"]
        if self.head == "scalar":
            output = model_forward(self.model, mb)  # [b, S, 1] scores
            return heads.last_token_scores(output, mb["lengths"]).cpu()
        lengths, T = mb["prompt_lengths"], mb["response_ids"].shape[1]
        index = (lengths - 1).unsqueeze(1) + torch.arange(T, device=ids.device)
        mb["response_index"] = index.clamp(max=ids.shape[1] - 1)  # as Experience.response_index
        z = model_forward(self.model, mb, response_rows(mb))  # the response positions' logits
        group = self.layout.pg_collection.tp if self.layout.tp > 1 else None
        logp = per_response_token(lambda x, y: token_logprobs(x, y, group, self.vocab_size, self.temperature), z, mb)
        return logp.float().cpu()


def _concat_rows(parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Row dicts -> one, input_ids RIGHT-padded (sequences start at position 0) to the widest."""
    width = max(p["input_ids"].shape[1] for p in parts)
    out = {k: torch.cat([p[k].cpu() for p in parts]) for k in parts[0] if k != "input_ids"}
    out["input_ids"] = torch.cat([torch.nn.functional.pad(p["input_ids"].cpu(), (0, width - p["input_ids"].shape[1]))
                                  for p in parts])
    return out


def build_inference_model(cfg, model_cfg, layout: Layout, head: str, load: str, source_name: str,
                          temperature: float, tokenizer=None, key: Optional[str] = None) -> InferenceModel:
    """A frozen model in `layout` with the weights of checkpoint `load` (collective), read straight into
    that layout: dist_checkpointing reshards at load, given the layout's own DP group for replica ids.
    The vocabulary keeps the training TP's padding (`build_in_layout`), so its global shape is the one
    the training layout loads. `tokenizer`: the fingerprint the checkpoint must match (None: no check); `key`: the
    setting `load` came from, for errors."""
    from megatron_rlhf.checkpoint import state as ckpt

    [model] = ckpt.load_built(
        load, lambda initialise: [build_in_layout(model_cfg, cfg.parallel.tp, layout, head=head,
                                                  initialise=initialise)],
        source_name, head, dp_group=layout.pg_collection.dp, key=key, tokenizer=tokenizer)
    for p in model.parameters():
        p.requires_grad_(False)
    return InferenceModel(model, layout, head, model_cfg.vocab_size, temperature)


class InferenceLayouts:
    """The inference layouts of a run's frozen models, one per TP (`ppo.inference_tp`, `ppo.reward_inference_tp`),
    made when first asked for (collective: every rank builds the same models in the same order)."""

    def __init__(self, cfg):
        self.cfg, self.layouts = cfg, {}

    def build(self, tp: int, model_cfg, head: str, load: str, source_name: str, tokenizer=None,
              key: Optional[str] = None) -> InferenceModel:
        from megatron_rlhf.rollout.layout import tp_only_layout

        if tp not in self.layouts:
            self.layouts[tp] = tp_only_layout(tp)
        return build_inference_model(self.cfg, model_cfg, self.layouts[tp], head, load, source_name,
                                     self.cfg.ppo.temperature, tokenizer, key=key)
