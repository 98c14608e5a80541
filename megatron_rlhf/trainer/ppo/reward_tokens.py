"""A reward model with its own tokenizer (`ppo.reward_tokenizer`): the policy's rows in the reward model's tokens.

InstructGPT-style pairs (a Qwen policy scored by a Llama reward model) share no vocabulary. Per row of a policy
micro-batch: the response tokens before the policy's stop id are decoded to text (special tokens the policy wrote
mid-response stay as their text, as the eval's samples and the gold scorer see them); the prompt, as written in the
prompt file (text, or messages: `prompt_source`), and that text are rendered for the reward model exactly as the
preference loader renders a {prompt, chosen} row for it (data/dataset.py `row_renderer`: its special
tokens and EOS, or its chat template with the answer cut at its first stop id), so the reward model scores what
it was trained on. Rows longer than its positions keep the start of the prompt and the whole response (where
the response fits: else its start), and are counted.

The missing-EOS penalty still reads the policy's own stop set (the policy micro-batch's `ended`).

    rows = RewardTokens(policy_tokenizer, reward_tokenizer, data_cfg, sources, limit)
    rows(mb) -> {input_ids [b, S_r] right-padded, lengths [b]}    # experience.scoring_rows' form
"""

from __future__ import annotations

import json
import time
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_rlhf.data.tokenizer import DataError

Batch = Dict[str, torch.Tensor]


class RewardTokens:
    """Policy micro-batch -> the reward model's scoring rows (module docstring). `sources`: the policy's prompt
    ids (a tuple) -> that prompt's `prompt_source` (JSON: the text or the messages), for every prompt the run
    samples (training and held-out). `limit`: the reward model's max_position_embeddings.

    Counters for the trainer's log: `seconds` spent, `rows` rendered, `truncated` rows (`take_counts` resets them)."""

    def __init__(self, policy_tokenizer, reward_tokenizer, data_cfg, sources: Dict[Tuple[int, ...], str], limit: int):
        from megatron_rlhf.data.dataset import row_renderer

        self.policy_tokenizer, self.reward_tokenizer, self.limit = policy_tokenizer, reward_tokenizer, limit
        self.render = row_renderer(data_cfg, reward_tokenizer)
        self.sources = sources
        self.seconds, self.rows, self.truncated = 0.0, 0, 0

    def __call__(self, mb: Batch) -> Batch:
        started = time.perf_counter()
        lengths = mb["response_mask"].sum(-1).long().tolist()
        sequences = []
        for i, n in enumerate(lengths):
            prompt = tuple(mb["input_ids"][i, : int(mb["prompt_lengths"][i])].tolist())
            ended = bool(mb["ended"][i])
            response = mb["response_ids"][i, : n - 1 if ended else n].tolist()  # an ended row's last token: its stop id
            sequences.append(self.sequence(prompt, response, ended))
        width = max(len(s) for s in sequences)
        pad = self.reward_tokenizer.pad_token_id or 0
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        self.seconds += time.perf_counter() - started
        self.rows += len(sequences)
        return {"input_ids": ids, "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.long)}

    def sequence(self, prompt_ids: Tuple[int, ...], response_ids: Sequence[int], ended: bool) -> List[int]:
        """One row: the reward model's ids of the prompt (by the policy's prompt ids) and the response tokens
        (before the stop id), cut to `limit`."""
        source = self.sources.get(prompt_ids)
        if source is None:
            raise DataError(f"ppo.reward_tokenizer: a rollout's prompt ({len(prompt_ids)} policy tokens) is not among "
                            "the loaded prompts, so it cannot be rendered for the reward model")
        # With its special tokens, as the eval's samples and the gold scorer read it: a marker the policy wrote
        # mid-response is part of what it wrote (its stop id is not: the row's `ended` says it ended).
        text = self.policy_tokenizer.decode(list(response_ids), skip_special_tokens=False)
        try:
            ids, prompt_length = self.render.sequence(json.loads(source), text, ended)
        except Exception as e:  # a template that cannot render the turn: the row names nothing else to fix
            raise DataError(f"ppo.reward_tokenizer: could not render a response for the reward model: {e}") from None
        return self._fit(ids, prompt_length)

    def _fit(self, ids: List[int], prompt_length: int) -> List[int]:
        if len(ids) <= self.limit:
            return ids
        self.truncated += 1
        prompt, response = ids[:prompt_length], ids[prompt_length:]
        room = self.limit - len(response)
        if room >= 1:
            return prompt[:room] + response
        return prompt[:1] + response[: self.limit - 1]

    def take_counts(self) -> Tuple[float, int, int]:
        """(seconds, rows, truncated) since the last call."""
        out = (self.seconds, self.rows, self.truncated)
        self.seconds, self.rows, self.truncated = 0.0, 0, 0
        return out


def prompt_sources(*datasets) -> Dict[Tuple[int, ...], str]:
    """Policy prompt ids -> prompt_source over prompt datasets (data.load_examples("prompt", ...)). Two prompts that
    the policy's tokenizer renders alike keep the first one's source."""
    out: Dict[Tuple[int, ...], str] = {}
    for ds in datasets:
        if ds is None:
            continue
        for ids, source in zip(ds["prompt_ids"], ds["prompt_source"]):
            out.setdefault(tuple(ids), source)
    return out


def load_reward_tokenizer(cfg, sources: Dict[Tuple[int, ...], str]):
    """ppo.reward_tokenizer, checked against the reward model and the prompts (DataError, one line), or None when
    unset. Called at start, before any model is built."""
    from megatron_rlhf.config.stage_models import other_models
    from megatron_rlhf.data import tokenizer as T

    path = cfg.ppo.reward_tokenizer
    if path is None:
        return None
    tokenizer = T.load_tokenizer(path, key="ppo.reward_tokenizer")
    [reward] = [m for m in other_models(cfg) if m.name == "reward"]
    if len(tokenizer) > reward.arch.vocab_size:
        raise DataError(f"ppo.reward_tokenizer: the tokenizer at '{path}' has {len(tokenizer)} tokens but the reward "
                        f"model in {cfg.ppo.reward_load} has vocab_size={reward.arch.vocab_size}: give the tokenizer "
                        "that reward model was trained with")
    chat = any(source.startswith("[") for source in sources.values())
    if chat and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"ppo.reward_tokenizer: the prompts are chat messages but the tokenizer at '{path}' has no "
                        "chat template to render them for the reward model: give a tokenizer with a chat template, or "
                        "text prompts")
    if cfg.data.append_eos and tokenizer.eos_token_id is None:
        raise DataError(f"ppo.reward_tokenizer: the tokenizer at '{path}' has no EOS token, which ends each finished "
                        "response as the reward model was trained (data.append_eos): give one with an eos_token")
    return tokenizer
