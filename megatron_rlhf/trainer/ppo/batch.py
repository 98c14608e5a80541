"""`Experience`: the one contract between PPO's phases (rollout -> score -> advantages -> learn).

Shapes (B rollouts, S = longest prompt + response in the batch, T = max_new_tokens):

    input_ids        [B, S] long   prompt then response, RIGHT-padded (real tokens at their true positions)
    prompt_lengths   [B]    long   real prompt tokens of each row
    response_ids     [B, T] long   sampled tokens, right-padded
    response_mask    [B, T] float  1.0 on real response tokens (EOS included)
    ended            [B]    bool   the response emitted EOS
    sampler_logprobs [B, T] float  log-probs the generation engine reported (for the rho diagnostics)
    logprobs         [B, T] float  log pi_old(y_t | s_t), recomputed by the trainer's forward (PPO's old logprobs)
    ref_logprobs     [B, T] float  log pi_ref(y_t | s_t)
    values           [B, T] float  V(s_t): the value model at the token BEFORE y_t
    rm_scores        [B]    float  normalised RM score at the last real token
    scores           [B]    float  rm_scores, or -missing_eos_penalty where the response has no EOS
    rewards, advantages, returns [B, T] float

Position arithmetic: response token k of row i sits at input position p_i + k and is predicted by the
logits (and valued by the value model) at position p_i + k - 1: `response_index()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Sequence

import torch

from megatron_rlhf.data.collate import token_groups

TOKEN_FIELDS = ("response_ids", "response_mask", "sampler_logprobs", "logprobs", "ref_logprobs", "values",
                "rewards", "advantages", "returns")


@dataclass
class Experience:
    input_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    ended: torch.Tensor
    sampler_logprobs: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    rm_scores: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] long: real response tokens per row."""
        return self.response_mask.sum(-1).long()

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """[B] long: prompt + response tokens per row."""
        return self.prompt_lengths + self.response_lengths

    def response_index(self) -> torch.Tensor:
        """[B, T] long: the input position whose output predicts (or values) response token k."""
        T = self.response_ids.shape[1]
        index = (self.prompt_lengths - 1).unsqueeze(1) + torch.arange(T, device=self.input_ids.device)
        return index.clamp(max=self.input_ids.shape[1] - 1)

    def rows(self, index: Sequence[int] | torch.Tensor) -> "Experience":
        """The sub-batch of rows `index`, with input columns trimmed to its longest sequence."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index])
                  for f in fields(self)}
        out = Experience(**picked)
        width = int(out.sequence_lengths.max()) if out.size else 1
        out.input_ids = out.input_ids[:, :width]
        return out

    def microbatches(self, micro_batch_size: int, same_width: Optional[bool] = None,
                     max_tokens: Optional[int] = None) -> List[Dict[str, torch.Tensor]]:
        """Consecutive micro-batches as dicts for Megatron's schedule (`input_ids`, `response_index`, `lengths`
        [b] (prompt + response tokens) and every field that is set).

        same_width: right-pad every micro-batch's input_ids to the widest one (pipeline stages exchange
        activations of one fixed shape; right padding changes no causal output at a real position).
        None: only under pipeline parallelism, so pp=1 computes exactly what it did before. Under sequence
        parallelism every width is a multiple of the TP size too (models/packing.py `pad_widths`).
        max_tokens (train.max_tokens_per_micro_batch): consecutive rows grouped by their tokens
        (data/collate.py `token_groups`; with packing on, by default up to micro_batch_size rows of the longest)."""
        out = []
        from megatron_rlhf.models import packing

        for group in token_groups(self.sequence_lengths.tolist(), micro_batch_size, max_tokens, packing.enabled()):
            part = self.rows(group)
            mb = {f.name: getattr(part, f.name) for f in fields(part) if getattr(part, f.name) is not None}
            mb["response_index"] = part.response_index()
            mb["lengths"] = part.sequence_lengths  # what packing lays end to end (models/packing.py)
            out.append(mb)
        return packing.pad_widths(out, _pipeline_parallel() if same_width is None else same_width)


def _pipeline_parallel() -> bool:
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1


def build_experience(prompt_ids: Sequence[Sequence[int]], generation: Dict[str, torch.Tensor], pad_id: int) -> Experience:
    """Prompt token lists + a `RolloutEngine.generate` result -> an Experience (rollout fields only)."""
    lengths = generation["lengths"].cpu()
    response = generation["response_ids"].cpu()
    sequences = [list(p) + response[i, : int(lengths[i])].tolist() for i, p in enumerate(prompt_ids)]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return Experience(
        input_ids=input_ids,
        prompt_lengths=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        response_ids=response,
        response_mask=generation["response_mask"].cpu().float(),
        ended=generation["ended"].cpu().bool(),
        sampler_logprobs=generation["logprobs"].cpu().float(),
    )


def all_gather_experience(exp: Experience, group) -> Experience:
    """Concatenate every rank's Experience over `group` in rank order (all ranks hold the same B).

    Used so each data-parallel rank can cut any minibatch of the global rollout batch: the minibatches
    then do not depend on how many ranks generated it."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return exp
    width = torch.tensor([exp.input_ids.shape[1]])
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
    pad = int(width) - exp.input_ids.shape[1]
    local = replace(exp, input_ids=torch.nn.functional.pad(exp.input_ids, (0, pad), value=0))
    gathered = {}
    for f in fields(local):
        t = getattr(local, f.name)
        if t is None:
            gathered[f.name] = None
            continue
        send = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()  # gloo has no bool collectives
        parts = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(parts, send, group=group)
        gathered[f.name] = torch.cat(parts).to(t.dtype)
    return Experience(**gathered)
