"""PPO math as pure functions over tensors (torch only; no megatron, vllm, transformers, omegaconf).

Read in the order of one PPO iteration (see shared/reference/ppo-spec.md):

- `kl`: per-token KL estimators k1/k2/k3 and the fixed / adaptive KL-coefficient controllers
- `rewards`: shaped token rewards (score on the last real token, -beta*KL on every token)
- `advantages`: GAE, and the group baselines of the value-free siblings (GRPO, RLOO)
- `masked`: masked sum / mean / var / whiten, global over a process group when given one
- `losses`: clipped policy loss, clipped value loss, entropy bonus, Bradley-Terry, DPO
- `correction`: token weights for the sampler/trainer gap (truncated or masked importance sampling)

Conventions: per-token tensors are [B, T] over response tokens, right-padded; `mask` is 1.0 on real
tokens and 0.0 on padding. Losses return token SUMS plus a dict of detached statistics (also sums);
the trainer divides by the token count all-reduced over data-parallel ranks, so results do not
depend on DP size or micro-batching. Nothing here calls `.item()` (no host-device sync).
"""

from megatron_rlhf.algo import advantages, correction, kl, losses, masked, rewards

__all__ = ["advantages", "correction", "kl", "losses", "masked", "rewards"]
