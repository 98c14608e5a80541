"""Memory/layout planner: `megatron-rlhf plan` (params.py: counts, memory.py: bytes, planner.py: the plan)."""
