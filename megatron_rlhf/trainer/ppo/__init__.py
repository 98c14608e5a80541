"""Stage 3: PPO with four models (and its critic-free siblings GRPO, RLOO, ReMax; PPO-ptx).

- `fit`: the loop, readable top to bottom (generate, score, advantages, learn, evaluate, checkpoint).
- `batch`: the `Experience` of one iteration; `experience`: scoring, recomputation and advantages;
  `critic_free`: the group estimators; `learn`: the PPO epochs; `ptx`: pre-training mix-in;
  `eval`: held-out evaluation; `doctor`: live warnings.
- `models`: the four models, with `inference_layout` and `reference_swap` for the frozen ones.
"""
