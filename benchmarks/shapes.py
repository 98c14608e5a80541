"""The PPO benchmark's shape, shared by our side (ppo_iteration.py) and TRL's (trl_reference.py)."""

from __future__ import annotations

import torch

# The tiny reference shape: per-op overhead dominates here.
SHAPE = dict(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
             vocab_size=512, max_position_embeddings=512)
# The realistic shape: SmolLM2-135M (random weights; time is in the kernels here).
SMOLLM2_135M = dict(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9, num_query_groups=3,
                    vocab_size=49152, max_position_embeddings=2048, rotary_base=100000.0, tie_embeddings=True)
PROMPTS, EPOCHS, MINIBATCHES = 16, 4, 2


def random_prompts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (PROMPTS,), generator=g)
    width = int(lengths.max())
    ids = torch.zeros(PROMPTS, width, dtype=torch.long)
    mask = torch.zeros(PROMPTS, width, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        ids[i, width - n:] = torch.randint(1, SHAPE["vocab_size"], (n,), generator=g)
        mask[i, width - n:] = True
    return ids, mask
