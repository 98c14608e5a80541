"""Construction of policy, reference, value and reward models for a given layout.

All four are Megatron `GPTModel`s; value and reward models swap the LM output layer for a
`ScalarHead`. Under pipeline parallelism (optionally virtual), a rank builds the list of model
chunks it owns; the head lives on the last stage only.
"""

from __future__ import annotations

from typing import List, Literal, Optional

import torch

from megatron_rlhf.models.heads import ScalarHead
from megatron_rlhf.models.spec import ModelConfig, decoder_spec, transformer_config
from megatron_rlhf.parallel.device import compute_device
from megatron_rlhf.parallel.layout import Fp8Config, ParallelConfig

Head = Literal["lm", "scalar"]


def build_model_chunk(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    head: Head = "lm",
    fp8: Optional[Fp8Config] = None,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    pg_collection=None,
):
    """One GPTModel (chunk) for this rank. `config` defaults to `transformer_config(model, parallel, fp8)`.

    `pg_collection` (a Megatron `ProcessGroupCollection`): the model's own process groups, for a layout
    other than the one in Megatron's parallel state (rollout/hybrid.py); None: parallel state's."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_rlhf.models import logit_rows
    from megatron_rlhf.models import rope as rope_kernel

    rope_kernel.install()  # Megatron's unfused RoPE in fewer passes, same results (models/rope.py)
    config = config or transformer_config(model, parallel, fp8)
    rope = model.rope_scaling or {}
    scalar = head == "scalar"
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, te=True if fp8 is not None and fp8.format is not None else None,
                                            vp_stage=vp_stage, pp_rank=pg_collection.pp.rank() if pg_collection else None),
        vocab_size=model.padded_vocab_size(parallel.tp),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_embeddings and not scalar,
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
        rope_scaling=rope.get("type") == "llama3",
        rope_scaling_factor=rope.get("factor", 8.0),
        seq_len_interpolation_factor=rope["factor"] if rope.get("type") == "linear" else None,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    if scalar and post_process:
        tp_group = pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()
        gpt.output_layer = ScalarHead(config, model.hidden_size, tp_group=tp_group)
    elif post_process:
        logit_rows.install(gpt)  # logits batch-major, and at chosen rows only (models/logit_rows.py)
    _cast_params(gpt, config.params_dtype)
    gpt.to(compute_device())  # Megatron leaves the move to the caller, as its own training's get_model does
    return gpt


def _cast_params(chunk: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter in `dtype`, as Megatron's own training gets by wrapping the model in
    `Float16Module`. The torch RMSNorm that the local spec falls back to without Apex ignores
    `params_dtype` and keeps fp32 weights; Megatron's mixed-precision optimizer maps its state to
    checkpoint tensors through the fp16/bf16 parameters only, so one fp32 parameter in a bf16 model
    made every bf16 checkpoint save fail (`Param id N does not match any model sharded param`)."""
    for param in chunk.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _left_as_allocated(weight: torch.Tensor) -> torch.Tensor:
    return weight


def initialisation(initialise: bool) -> dict:
    """`transformer_config` overrides: none (Megatron draws every weight), or, when a checkpoint will write
    every weight, nothing drawn: each weight allocated in place on its device (no whole host-side master
    weight split over TP ranks), then left as it is."""
    if initialise:
        return {}
    return dict(init_method=_left_as_allocated, output_layer_init_method=_left_as_allocated,
                embedding_init_method=_left_as_allocated, use_cpu_initialization=False)


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    head: Head = "lm",
    fp8: Optional[Fp8Config] = None,
    initialise: bool = True,
) -> List[torch.nn.Module]:
    """The model chunks this rank owns (one per virtual pipeline stage; a list of one without VPP).

    `initialise=False`: a checkpoint will write every weight, so none is drawn at random (on CPU Megatron
    draws each whole weight on the host: seconds per model at 135M parameters, which loading then
    overwrites); the weights hold whatever memory held until then. The tensor-parallel attributes that
    the optimizer and the resharding read are set all the same.
    Requires `parallel.init.initialize(...)` to have run (process groups and RNG seeds).
    """
    from megatron.core import parallel_state

    config = transformer_config(model, parallel, fp8, **initialisation(initialise))
    vpp = parallel.vpp or 1
    chunks = []
    for vp_stage in range(vpp):
        stage_kwargs = {"vp_stage": vp_stage if parallel.vpp else None}
        chunks.append(
            build_model_chunk(
                model,
                parallel,
                head=head,
                fp8=fp8,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, **stage_kwargs),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, **stage_kwargs),
                config=config,
                **stage_kwargs,
            )
        )
    return chunks
