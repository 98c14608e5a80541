"""megatron_rlhf: RLHF with PPO on Megatron-Core (SFT -> Bradley-Terry reward model -> PPO).

Importing the package needs neither CUDA, Transformer Engine nor vLLM: those are imported lazily
where they are used.
"""

__version__ = "0.1.0"
