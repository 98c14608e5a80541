"""KV-cache sampler on the Megatron policy itself (CPU and GPU): the engine wherever vLLM is absent.

Decoding uses Megatron-Core's `StaticInferenceContext` (one KV cache slot per position per row):
a prefill forward with the causal mask, then one token per forward with `attention_mask=None`
(the cache holds the past), `sequence_len_offset` advanced by the tokens consumed, and
`runtime_gather_output=True` so TP ranks see the whole (vocab-parallel) logits row.

Prompts of different lengths. Prompts arrive LEFT-padded, but they are decoded right-aligned: row i
holds its prompt in cache slots [0, len_i), so every real token sits at its true position (RoPE
angle = slot) and no padding ever enters the cache before a real token. The common prefix
[0, min_len) is prefilled in one forward; after that each step feeds one column: the row's own
prompt token while the row is still inside its prompt (the prediction is discarded), a sampled
token once it is past it. This is exact on every attention backend (local or Transformer Engine),
because it needs no custom attention mask. The price is one single-token step per column between
the shortest and the longest prompt.

Forward path: `rollout/lean_decode.py`'s `LeanDecoder` (the same function over the model's own
parameters, without Megatron's per-step module overhead) whenever it implements the model's config,
Megatron's own forward through a `StaticInferenceContext` otherwise. `decode_path(model)` says which
runs and why; `generate(..., path="module")` forces Megatron's forward.

Sampling: logits are gathered over TP, cut to the true vocabulary (Megatron pads the vocab so TP
shards are equal; padded ids are never sampled), cast to fp32, divided by the temperature. With
TP > 1 the token picked by TP rank 0 is broadcast to the other TP ranks, so they decode the same
sequence even if their logits differ in the last bit; seed every TP rank of a group identically
(and data-parallel ranks differently) so generator states stay in step.

Limits: pipeline parallelism, context parallelism and sequence parallelism are not supported here
(each raises NotImplementedError saying what to do); generate with a tp-only layout or use vLLM.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from megatron_rlhf.data.tokenizer import stop_ids, stop_set
from megatron_rlhf.parallel.device import device_of
from megatron_rlhf.rollout.base import RolloutEngine, SamplingParams

Model = Union[torch.nn.Module, Sequence[torch.nn.Module]]
_log = logging.getLogger(__name__)


def generate(
    model: Model,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: Union[None, int, Sequence[int]],
    pad_id: int,
    vocab_size: int,
    prompt_mask: Optional[torch.Tensor] = None,
    prompt_lengths: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: Optional[torch.Generator] = None,
    seed: Optional[int] = None,
    uniforms: Optional[torch.Tensor] = None,
    path: str = "auto",
    top_k: int = 0,
    top_p: float = 1.0,
) -> Dict[str, torch.Tensor]:
    """Sample up to `max_new_tokens` tokens after each prompt with the KV cache.

    model: the policy: a GPTModel, or the list of chunks from `models.build.build_model` (one chunk:
        pp=1), possibly wrapped in Megatron DDP / Float16Module (unwrapped here). Put in eval mode
        for the call; its previous mode is restored afterwards.
    prompt_ids [b, s] long, LEFT-padded. Give exactly one of prompt_mask [b, s] (bool/0-1, True on
        real tokens, which must be the last ones of each row) or prompt_lengths [b] (real tokens are
        the last prompt_lengths[i] columns). Every prompt needs at least one real token. The prompts may
        be on the host with the model on a GPU; the results are on the model's device.
    eos_id: generation of a row stops after it emits this id, or any id of a sequence of them (the stop set,
        data/tokenizer.py `stop_ids`); None or (): always run max_new_tokens.
    pad_id: filler for response_ids after the end of each response.
    vocab_size: the TRUE vocabulary size; logits for padded ids (>= vocab_size) are dropped.
    temperature, greedy, top_k, top_p: see `SamplingParams`.
    generator / seed: sampling RNG (a torch.Generator on the model's device, or a seed to make one);
        neither: torch's default generator. Each step draws one uniform per row from it (inverse CDF).
    uniforms [b, T] float in [0, 1): instead of an RNG, response token k of row i is drawn by inverse CDF
        with uniforms[i, k]. The draw then depends on the row alone, not on the batch it sits in, so
        a batch split over data-parallel ranks samples the same tokens as on one rank (PPO uses this).
    path: "auto" (the lean forward when it supports the model, see `decode_path`), "lean" (it, or a
        ValueError saying why it cannot), "module" (Megatron's forward).

    Returns the dict described in `rollout/base.py`: response_ids, response_mask, logprobs [b, T],
    ended, lengths [b], with T = max_new_tokens.
    """
    sampling = SamplingParams(max_new_tokens, temperature, greedy, top_k, top_p)
    gpt = _single_chunk(model)
    use_lean = _use_lean(gpt, path)
    device = device_of(gpt)
    prompt_ids = prompt_ids.to(device)  # prompts may come from the host while the model is on a GPU
    lengths = _prompt_lengths(prompt_ids, prompt_mask, prompt_lengths).to(device)
    stops = stop_set(eos_id)
    _check_ids(prompt_ids, lengths, vocab_size, stops, pad_id)
    eos_id = torch.tensor(stops, dtype=prompt_ids.dtype, device=device) if stops else None
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    was_training = gpt.training
    gpt.eval()
    try:
        with torch.no_grad():
            if uniforms is not None and tuple(uniforms.shape) != (prompt_ids.shape[0], max_new_tokens):
                raise ValueError(f"uniforms {tuple(uniforms.shape)} must be [batch, max_new_tokens] = "
                                 f"({prompt_ids.shape[0]}, {max_new_tokens})")
            draws = None if uniforms is None else uniforms.to(device)
            return _decode(gpt, prompt_ids, lengths, sampling, eos_id, pad_id, vocab_size, generator, draws,
                           lean=use_lean)
    finally:
        gpt.train(was_training)


def generate_for_prompts(model: Model, examples: Sequence[dict], tokenizer, *, vocab_size: int,
                         max_new_tokens: int, temperature: float = 1.0, generator=None, seed=None) -> Dict[str, torch.Tensor]:
    """`generate` for tokenised prompt rows (`data.load_examples("prompt", ...)`: `prompt_ids`),
    left-padded with `collate.collate_prompts`, ending at the tokenizer's stop set (`stop_ids`)."""
    from megatron_rlhf.data.collate import collate_prompts

    batch = collate_prompts(examples, pad_id=tokenizer.pad_token_id)
    return generate(model, batch["input_ids"], prompt_mask=batch["attention_mask"], max_new_tokens=max_new_tokens,
                    eos_id=stop_ids(tokenizer), pad_id=tokenizer.pad_token_id, vocab_size=vocab_size,
                    temperature=temperature, generator=generator, seed=seed)


class MegatronRolloutEngine(RolloutEngine):
    """`RolloutEngine` over the policy's own Megatron chunks (weights shared with training)."""

    shares_policy_weights = True

    def __init__(self, model: Model, *, eos_id: Union[None, int, Sequence[int]], pad_id: int, vocab_size: int):
        self.model = model
        self.eos_id, self.pad_id, self.vocab_size = eos_id, pad_id, vocab_size

    def generate(self, prompt_ids, prompt_mask, sampling: SamplingParams, generator=None, uniforms=None):
        return generate(
            self.model, prompt_ids, prompt_mask=prompt_mask, max_new_tokens=sampling.max_new_tokens,
            eos_id=self.eos_id, pad_id=self.pad_id, vocab_size=self.vocab_size,
            temperature=sampling.temperature, greedy=sampling.greedy, generator=generator, uniforms=uniforms,
            top_k=sampling.top_k, top_p=sampling.top_p,
        )

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError(
            "the megatron engine generates with the policy's own parameters: there is nothing to update "
            "(check engine.shares_policy_weights before streaming weights)"
        )


# --------------------------------------------------------------------------- decoding


def _decode(gpt, prompt_ids, lengths, sampling: SamplingParams, eos_id, pad_id, vocab_size, generator, uniforms=None,
            lean: bool = False):
    """The decoding loop. Per step: one forward, one pick, and a handful of column writes; nothing
    waits on the device except the early stop check with an EOS id (after the last prompt ends)."""
    b, T = prompt_ids.shape[0], sampling.max_new_tokens
    device = prompt_ids.device
    host_lengths = lengths.cpu()
    shortest, longest = int(host_lengths.min()), int(host_lengths.max())
    width = longest + T
    if width - 1 > gpt.max_sequence_length:  # the last sampled token is never fed back
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({T}) - 1 = {width - 1} exceeds the model's "
            f"max_position_embeddings={gpt.max_sequence_length}: shorten the prompts or max_new_tokens"
        )
    # seq [b, width]: each row's prompt right-aligned at slot 0, then its response: row i's response
    # token j sits at slot len_i + j, and its log-prob at the same slot of slot_logprobs.
    seq = _right_aligned(prompt_ids, lengths, width, pad_id)
    slot_logprobs = torch.zeros(b, width, dtype=torch.float32, device=device)
    slot = torch.arange(width, device=device).unsqueeze(0)  # [1, width]
    in_response = (slot >= lengths.unsqueeze(1)) & (slot < (lengths + T).unsqueeze(1))  # [b, width]
    positions = slot.expand(b, -1)
    # uniforms [b, T] -> [b, width]: slot t of row i gets response draw clamp(t - len_i, 0, T - 1).
    slot_uniforms = None
    if uniforms is not None:
        slot_uniforms = uniforms.gather(1, (slot - lengths.unsqueeze(1)).clamp(0, T - 1))
    ended = torch.zeros(b, dtype=torch.bool, device=device)
    last_slot = lengths + (T - 1)  # a row is complete once this slot is sampled
    tp_group = _tp_group_to_agree(gpt)

    if lean:
        from megatron_rlhf.rollout.lean_decode import LeanDecoder

        decoder = LeanDecoder(gpt, b, width)
    else:
        decoder = ModuleDecoder(gpt, b, width)
    logits = decoder.prefill(seq[:, :shortest], positions[:, :shortest])  # the common prefix
    for t in range(shortest, width):  # `logits` predicts slot t
        u = None if slot_uniforms is None else slot_uniforms[:, t]
        token, token_logprob = _pick(logits, vocab_size, sampling, generator, u, tp_group)
        # A row takes the token while slot t is in its response and it has not ended; other rows
        # keep their prompt token or pad, which is what they are fed next.
        take = in_response[:, t] if eos_id is None else in_response[:, t] & ~ended
        seq[:, t] = torch.where(take, token, seq[:, t])
        slot_logprobs[:, t] = token_logprob
        if eos_id is not None:
            ended |= take & torch.isin(token, eos_id)
            if t >= longest and bool((ended | (last_slot <= t)).all()):
                break
        if t == width - 1:
            break
        logits = decoder.step(seq[:, t : t + 1], positions[:, t : t + 1])
    return _responses(seq, slot_logprobs, lengths, ended, T, eos_id, pad_id)


def _responses(seq, slot_logprobs, lengths, ended, T: int, eos_id, pad_id: int) -> Dict[str, torch.Tensor]:
    """Cut each row's response out of the slot buffers [b, width] (see `_decode`) -> the output dict."""
    at = lengths.unsqueeze(1) + torch.arange(T, device=seq.device).unsqueeze(0)  # [b, T] slots
    response = seq.gather(1, at)
    n_generated = torch.full_like(lengths, T)
    if eos_id is not None:
        # An ended row stops after its first stop id; later slots were never written.
        first_eos = torch.isin(response, eos_id).int().argmax(dim=1)
        n_generated = torch.where(ended, first_eos + 1, n_generated)
    mask = torch.arange(T, device=seq.device).unsqueeze(0) < n_generated.unsqueeze(1)
    return {
        "response_ids": torch.where(mask, response, torch.full_like(response, pad_id)),
        "response_mask": mask.float(),
        "logprobs": torch.where(mask, slot_logprobs.gather(1, at), torch.zeros_like(slot_logprobs[:, :T])),
        "ended": ended,
        "lengths": n_generated,
    }


class ModuleDecoder:
    """Megatron's own forward with a `StaticInferenceContext`: the `LeanDecoder` interface for any config.

    prefill(tokens, positions [b, n]) / step(tokens, positions [b, 1]) -> next-token logits [b, V_padded].
    Prefill uses the model's causal mask; later steps attend to the whole cache (Megatron switches the
    mask off once sequence_len_offset > 0). RoPE takes its angles from the cache slot, which is the
    true position here; position_ids are passed for embeddings that use them.
    """

    def __init__(self, gpt, batch: int, width: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.gpt = gpt
        self.ctx = StaticInferenceContext(max_batch_size=batch, max_sequence_length=width - 1)

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.step(tokens, positions)
        self.ctx.enable_decode_mode()
        return logits

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(tokens, positions, None, inference_context=self.ctx, runtime_gather_output=True)
        self.ctx.increment_sequence_len_offset(tokens.shape[1])
        return logits[:, -1, :]  # static contexts materialise only the last position anyway


def decode_path(model: Model) -> str:
    """Which forward `generate` runs for `model` by default: "lean", or "module: <why not lean>"."""
    from megatron_rlhf.rollout.lean_decode import unsupported_reason

    reason = unsupported_reason(_single_chunk(model))
    return "lean" if reason is None else f"module: {reason}"


def _use_lean(gpt, path: str) -> bool:
    """The `path` argument of `generate` -> whether the lean forward runs (logged at debug level)."""
    from megatron_rlhf.rollout.lean_decode import unsupported_reason

    if path not in ("auto", "lean", "module"):
        raise ValueError(f"path={path!r}: use 'auto', 'lean' or 'module'")
    reason = "forced by path='module'" if path == "module" else unsupported_reason(gpt)
    if reason is not None and path == "lean":
        raise ValueError(f"the lean decode forward does not support this model ({reason}): use path='auto' or 'module'")
    _log.debug("megatron sampler: %s", "lean forward" if reason is None else f"module forward ({reason})")
    return reason is None


def _pick(
    logits: torch.Tensor, vocab_size: int, sampling: SamplingParams, generator, u: Optional[torch.Tensor] = None,
    tp_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [b, V_padded] -> (token [b] long, its log-prob [b] fp32 under softmax(logits / temperature),
    restricted to the top-k / top-p ids when `sampling` asks: `_truncate`). Greedy: the argmax and its
    log-prob under softmax(logits) (base.py's contract).

    u [b] in [0, 1): the inverse-CDF draws (one per row); None: drawn from `generator`.
    With `tp_group` (from `_tp_group_to_agree`), TP rank 0's tokens are used on every rank.
    """
    if logits.shape[-1] < vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is larger than the model's {logits.shape[-1]} logits")
    z = logits[:, :vocab_size].float()
    if sampling.greedy:  # no sampling distribution: the model's own softmax (what vLLM reports at temperature 0)
        log_probs = torch.log_softmax(z, dim=-1)
        token = z.argmax(dim=-1)
    else:
        if sampling.temperature != 1.0:  # x / 1.0 == x exactly: skip the op, not a result
            z = z / sampling.temperature
        if sampling.truncates:
            z = _truncate(z, sampling.top_k, sampling.top_p)
        log_probs = torch.log_softmax(z, dim=-1)
        if u is None:
            # One uniform per row from `generator` (torch's default one if None), by inverse CDF: the
            # distribution of torch.multinomial, which instead draws and takes the log of one exponential
            # per vocabulary id (~20% of a decode step at 128 rows in benchmarks/rollout.py).
            u = torch.rand(z.shape[0], generator=generator, device=z.device)
        cdf = log_probs.exp().cumsum(dim=-1)
        # right=True: the first id whose cdf exceeds the draw, so zero-probability ids are never picked.
        token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1).clamp(max=vocab_size - 1)
    if tp_group is not None:
        torch.distributed.broadcast(token, src=torch.distributed.get_global_rank(tp_group, 0), group=tp_group)
    return token, log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)


def _truncate(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """z [b, V] (logits / temperature) -> z with -inf outside the kept ids: the top_k largest (0: all),
    then the smallest prefix of the rest, by descending probability, whose mass reaches top_p (the most
    likely id is always kept). Ties with the k-th largest value are kept too."""
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely ids
        drop = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, before >= top_p)
        z = z.masked_fill(drop, float("-inf"))
    return z


def _tp_group_to_agree(gpt):
    """The TP group whose rank 0 picks the tokens for all its ranks; None without TP (nothing to agree on).

    The model's own group (its `pg_collection`), so a copy built in another layout (rollout/hybrid.py)
    agrees within its own TP group, not the training one."""
    group = getattr(getattr(gpt, "pg_collection", None), "tp", None)
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
    return group if group is not None and torch.distributed.get_world_size(group) > 1 else None


# --------------------------------------------------------------------------- inputs


def _single_chunk(model: Model):
    """The GPTModel to decode with; refuses layouts this sampler does not handle."""
    from megatron.core.utils import unwrap_model

    from megatron_rlhf.models.heads import ScalarHead

    chunks: List[torch.nn.Module] = list(model) if isinstance(model, (list, tuple)) else [model]
    gpt = unwrap_model(chunks[0])
    config = gpt.config
    pp = config.pipeline_model_parallel_size  # the model's own layout (a hybrid copy differs from training's)
    if len(chunks) != 1 or pp > 1:
        raise NotImplementedError(
            f"the megatron sampler needs pp=1 (got pp={pp}, {len(chunks)} model chunks on this rank): "
            "generate in a tp-only layout (rollout.tp, rollout/hybrid.py), or use the vLLM engine"
        )
    if config.context_parallel_size > 1:
        raise NotImplementedError(
            f"the megatron sampler needs cp=1 (got cp={config.context_parallel_size}): generate with a tp-only layout"
        )
    if config.sequence_parallel:
        raise NotImplementedError(
            "the megatron sampler needs sequence_parallel=False (single-token decode steps cannot be split "
            "over TP ranks): generate with a copy of the policy built without sequence parallelism"
        )
    if isinstance(getattr(gpt, "output_layer", None), ScalarHead):
        raise ValueError("generate() needs a language-model head; this model has a scalar (value/reward) head")
    return gpt


def _prompt_lengths(prompt_ids, prompt_mask, prompt_lengths) -> torch.Tensor:
    """Real-token count per row [b] long, after checking the prompts are LEFT-padded."""
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [batch, seq], got shape {tuple(prompt_ids.shape)}")
    b, s = prompt_ids.shape
    if (prompt_mask is None) == (prompt_lengths is None):
        raise ValueError("pass exactly one of prompt_mask [b, s] or prompt_lengths [b]")
    if prompt_mask is not None:
        if prompt_mask.shape != prompt_ids.shape:
            raise ValueError(
                f"prompt_mask {tuple(prompt_mask.shape)} must have the shape of prompt_ids {(b, s)}"
            )
        lengths = prompt_mask.bool().sum(-1).long().cpu()
        expected = torch.arange(s).unsqueeze(0) >= (s - lengths).unsqueeze(1)
        if not torch.equal(prompt_mask.bool().cpu(), expected):
            raise ValueError("prompt_mask must mark LEFT-padded prompts (padding first, real tokens last in each row)")
    else:
        lengths = torch.as_tensor(prompt_lengths).long().cpu()
        if lengths.shape != (b,):
            raise ValueError(f"prompt_lengths {tuple(lengths.shape)} must be [batch] = ({b},)")
    if b == 0:
        raise ValueError("no prompts to generate from (batch size 0)")
    if int(lengths.min()) < 1 or int(lengths.max()) > s:
        raise ValueError(f"prompt lengths must be in [1, {s}], got min {int(lengths.min())} max {int(lengths.max())}")
    return lengths


def _check_ids(prompt_ids, lengths, vocab_size: int, stops: Tuple[int, ...], pad_id: int) -> None:
    s = prompt_ids.shape[1]
    real = torch.arange(s, device=prompt_ids.device).unsqueeze(0) >= (s - lengths).unsqueeze(1)
    ids = prompt_ids[real]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"prompt token ids must be in [0, vocab_size={vocab_size}), got [{int(ids.min())}, {int(ids.max())}]"
        )
    for eos_id in stops:
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id={eos_id} (a stop id) is not a token id of the vocabulary (size {vocab_size}): "
                             "fix generation_config.json's eos_token_id or the tokenizer's eos_token")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id={pad_id} must be a token id in [0, {vocab_size}) (it is fed to finished rows)")


def _right_aligned(prompt_ids: torch.Tensor, lengths: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    """LEFT-padded [b, s] -> [b, width] with row i's len_i real tokens at columns [0, len_i), pad_id after."""
    s = prompt_ids.shape[1]
    col = torch.arange(width, device=prompt_ids.device).unsqueeze(0)  # [1, width]
    src = (col + (s - lengths).unsqueeze(1)).clamp(max=s - 1)  # column of prompt_ids feeding column `col`
    out = torch.gather(prompt_ids, 1, src)
    return torch.where(col < lengths.unsqueeze(1), out, torch.full_like(out, pad_id))
