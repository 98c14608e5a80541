"""megatron_rlhf: RLHF with PPO on Megatron-Core (SFT -> Bradley-Terry reward model -> PPO).

Importing the package needs neither CUDA, Transformer Engine nor vLLM: those are imported lazily
where they are used.
"""

__version__ = "0.1.0"

from megatron_rlhf.parallel import eager_import as _eager_import  # noqa: E402

_eager_import.install()  # without CUDA, megatron-core imports without torch's compiler stack (see the module)
