"""Scalar head for value and reward models.

It takes the place of the LM output layer on the last pipeline stage, so a value/reward model is a
`GPTModel` whose forward returns [batch, seq, 1] scores instead of vocab logits. The head weight
is named `output_layer.weight` ([1, hidden]), which is what HF sequence classifiers call
`score.weight`.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


def last_token_scores(output: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """output [n, s, 1] per-token scores, lengths [n] -> [n] score at position lengths-1."""
    return output.squeeze(-1).gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1).float()


class ScalarHead(MegatronModule):
    """hidden [s, b, h] -> score [s, b, 1]; replicated on every TP rank (it is tiny)."""

    def __init__(self, config, hidden_size: int, tp_group=None):
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype))
        # Zero init: a fresh head predicts 0, which is the right prior for values and normalised scores.
        torch.nn.init.zeros_(self.weight)
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        # The same weight lives on every TP rank and sees the same (gathered) input, so its
        # gradients agree across TP ranks without a TP all-reduce (DDP still averages over DP).

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # every TP rank then computes the same whole output, so the backward
            # takes this rank's slice of its gradient as it is (a reduce-scatter would count it tp times)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                                 group=self.tp_group)
        return torch.matmul(hidden_states, self.weight.t()), None
