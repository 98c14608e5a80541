"""Colocated vLLM engine (GPU only; vllm is imported lazily, never at module import).

Written against vLLM's documented offline API and not yet run on a GPU (tests/gpu/test_vllm_engine.py
is the check to run on one). The pieces:

- one `vllm.LLM` per rank in the same torchrun job (`distributed_executor_backend="external_launcher"`),
  TP = rollout.tp over consecutive ranks, DP = world / tp, `enable_sleep_mode=True`, started from dummy
  weights (`load_format="dummy"`) with the policy's HF config.json, no tokenizer (prompts are token ids);
- each `generate`: wake the weights -> `load_weights` from the policy streamed as full HF tensors
  (`models/hf_mapping.iter_hf_weights`, a collective over the training layout) in buckets of
  `rollout.bucket_mb` -> wake the KV cache -> generate this generation-DP rank's rows
  (rollout/layout.py's `generate_in_layout`) -> sleep (level 1); from the weight update to the sleep the
  training weights wait in host memory (`rollout.release_training_weights`);
- sampling mapped one to one: temperature (0 for greedy), top-p/top-k only when asked, stop at EOS, `max_tokens`,
  the log-prob of each sampled token after temperature (`logprobs_mode="processed_logprobs"`).
  vLLM draws from its own RNG: per-row `uniforms` cannot be used (tokens then depend on the split).

`require_vllm()` runs at start when `rollout.engine=vllm`, so a run that cannot use vLLM fails with one
line before any work.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.config.rollout import require_vllm
from megatron_rlhf.models.hf_config import hf_config_for_export
from megatron_rlhf.models.hf_mapping import iter_hf_weights
from megatron_rlhf.rollout.base import RolloutEngine, SamplingParams
from megatron_rlhf.rollout.layout import Layout, generate_in_layout
from megatron_rlhf.rollout.offload import released


def buckets(named_tensors: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterable[List[Tuple[str, torch.Tensor]]]:
    """(name, tensor) stream -> lists of at least `bucket_bytes` (the last one may be smaller)."""
    bucket, size = [], 0
    for name, t in named_tensors:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def responses(token_lists: Sequence[Sequence[int]], logprob_lists: Sequence[Sequence[float]],
              ended: Sequence[bool], T: int, pad_id: int) -> Dict[str, torch.Tensor]:
    """Per-row sampled tokens and their log-probs -> base.py's dict [n, T] (right-padded with pad_id)."""
    n = len(token_lists)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    logprobs = torch.zeros(n, T, dtype=torch.float32)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    for i, (toks, lps) in enumerate(zip(token_lists, logprob_lists)):
        ids[i, : len(toks)] = torch.tensor(list(toks), dtype=torch.long)
        logprobs[i, : len(lps)] = torch.tensor(list(lps), dtype=torch.float32)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return {"response_ids": ids, "response_mask": mask, "logprobs": logprobs,
            "ended": torch.tensor(list(ended), dtype=torch.bool), "lengths": lengths}


class VLLMRolloutEngine(RolloutEngine):
    """vLLM in the generation layout TP = tp, DP = world / tp, colocated with training (module docstring)."""

    shares_policy_weights = False

    def __init__(self, train_chunks, model_cfg, tp: int, config_dir: str, *, eos_id: Optional[int], pad_id: int,
                 bucket_mb: int, seed: int, gpu_memory_utilization: float = 0.3,
                 release_device: Optional[str] = "auto"):
        require_vllm()
        import torch.distributed as dist
        from vllm import LLM

        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = Layout(tp, world // tp, rank % tp, rank // tp, None)
        self.train_chunks, self.model_cfg, self.release_device = train_chunks, model_cfg, release_device
        self.eos_id, self.pad_id, self.bucket_bytes = eos_id, pad_id, bucket_mb << 20
        if rank == 0:
            os.makedirs(config_dir, exist_ok=True)
            config = hf_config_for_export(model_cfg, "lm", model_cfg.torch_dtype(), None)
            with open(os.path.join(config_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
        dist.barrier()
        extra = {"data_parallel_size": world // tp} if world > tp else {}
        # The engine core in this process: `apply_model` hands it a closure, which a separate engine process
        # could only receive with insecure serialization switched on.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = LLM(model=config_dir, load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
                       distributed_executor_backend="external_launcher", enable_sleep_mode=True, seed=seed,
                       dtype=model_cfg.params_dtype, gpu_memory_utilization=gpu_memory_utilization,
                       logprobs_mode="processed_logprobs", **extra)
        self.llm.sleep(level=1)  # training runs first

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Full HF tensors -> vLLM's `load_weights` (it cuts its own TP shard), one bucket at a time."""
        for bucket in buckets(named_tensors, self.bucket_bytes):
            self.llm.apply_model(lambda model, b=bucket: model.load_weights(weights=b))

    def generate(self, prompt_ids, prompt_mask, sampling: SamplingParams, generator=None, uniforms=None):

        self.llm.wake_up(tags=["weights"])
        if self._copy_due():  # sleep level 1 kept the last weights in host memory: within same_weights, reuse them
            self.update_weights(iter_hf_weights(self.train_chunks, self.model_cfg, "lm"))
        # vLLM holds the weights now: training's wait in host memory (rollout.release_training_weights)
        # before the KV cache comes back, so the two never occupy the device together.
        with released(self.train_chunks, self.release_device):
            self.llm.wake_up(tags=["kv_cache"])
            try:
                return generate_in_layout(self.layout, lambda ids, mask, _draws: self._decode(ids, mask, sampling),
                                          prompt_ids, prompt_mask, None, self.pad_id)
            finally:
                self.llm.sleep(level=1)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingParams) -> Dict[str, torch.Tensor]:
        from vllm import SamplingParams as VLLMSampling

        params = VLLMSampling(
            n=1, temperature=0.0 if sampling.greedy else sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_new_tokens, logprobs=0, detokenize=False,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None, ignore_eos=self.eos_id is None)
        prompts = [{"prompt_token_ids": row[m].tolist()} for row, m in zip(ids, mask.bool())]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens, lps, ended = [], [], []
        for o in outs:
            c = o.outputs[0]
            tokens.append(list(c.token_ids))
            lps.append([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
            ended.append(c.finish_reason == "stop")
        return responses(tokens, lps, ended, sampling.max_new_tokens, self.pad_id)
