"""Generation engines for PPO rollouts behind one interface (`base.RolloutEngine`).

- `megatron_engine`: KV-cache sampling on the policy's own Megatron model (CPU and GPU, pp=1).
- a vLLM engine (GPU only) is imported lazily where it is used, never from here.
"""

from megatron_rlhf.rollout.base import GENERATION_KEYS, RolloutEngine, SamplingParams

__all__ = ["GENERATION_KEYS", "RolloutEngine", "SamplingParams"]
