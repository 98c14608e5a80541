"""Each impossible layout fails with one line naming the numbers, before any model is built."""

import os
import subprocess
import sys

import pytest

from megatron_rlhf.parallel.layout import Fp8Config, LayoutError, ParallelConfig, validate_layout


def check(parallel, world=8, **kw):
    defaults = dict(num_layers=8, num_attention_heads=8, num_query_groups=4)
    defaults.update(kw)
    validate_layout(parallel, world, **defaults)


@pytest.mark.parametrize(
    "parallel, world, kw, fragment",
    [
        (ParallelConfig(tp=3), 8, {}, "world size 8 is not divisible by tp*pp*cp = 3*1*1 = 3"),
        (ParallelConfig(tp=2, pp=2, cp=4), 8, {}, "world size 8 is not divisible by tp*pp*cp = 2*2*4 = 16"),
        (ParallelConfig(tp=4), 8, {"num_attention_heads": 6}, "model.num_attention_heads=6 is not divisible by parallel.tp=4"),
        (ParallelConfig(tp=8), 8, {"num_query_groups": 4}, "model.num_query_groups (key/value heads)=4 is not divisible by parallel.tp=8"),
        # SmolLM2-135M: 9 attention heads, 3 key/value heads
        (ParallelConfig(tp=2), 2, {"num_attention_heads": 9, "num_query_groups": 3},
         "model.num_attention_heads=9 is not divisible by parallel.tp=2: use a tp of 1, 3 (it must divide"),
        (ParallelConfig(pp=4), 8, {"num_layers": 6}, "model.num_layers=6 is not divisible by pp=4"),
        (ParallelConfig(pp=2, vpp=3), 8, {"num_layers": 8}, "model.num_layers=8 is not divisible by pp*vpp = 2*3 = 6"),
        (ParallelConfig(vpp=2), 8, {}, "parallel.vpp=2 needs parallel.pp > 1"),
        (ParallelConfig(tp=1, sequence_parallel=True), 8, {}, "sequence_parallel=true needs parallel.tp > 1"),
    ],
)
def test_bad_layouts(parallel, world, kw, fragment):
    with pytest.raises(LayoutError) as e:
        check(parallel, world, **kw)
    msg = str(e.value)
    assert fragment in msg
    assert "\n" not in msg


def test_sequence_parallel_runs_on_the_local_spec_too():
    check(ParallelConfig(tp=2, sequence_parallel=True), te_available=False)  # models/norm_glu.py's norms


def test_fp8_needs_cuda_and_te():
    fp8 = Fp8Config(format="hybrid")
    with pytest.raises(LayoutError, match="needs CUDA"):
        check(ParallelConfig(), fp8=fp8, cuda_available=False, te_available=True)
    with pytest.raises(LayoutError, match="needs Transformer Engine"):
        check(ParallelConfig(), fp8=fp8, cuda_available=True, te_available=False)
    with pytest.raises(LayoutError, match="not one of"):
        check(ParallelConfig(), fp8=Fp8Config(format="e5m2"), cuda_available=True, te_available=True)
    check(ParallelConfig(), fp8=fp8, cuda_available=True, te_available=True)  # fine when both exist


def test_good_layouts_pass():
    check(ParallelConfig(tp=2, pp=2))
    check(ParallelConfig(tp=2, pp=2, vpp=2, sequence_parallel=True), te_available=True)
    assert ParallelConfig(tp=2, pp=2).dp(8) == 2


def run_without_cuda(code: str) -> None:
    """Run `code` in a fresh interpreter that sees no GPU; it must print 'ok'."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code + "print('ok')\n"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_import_needs_no_cuda_te_or_vllm():
    """Importing the package (and its model/parallel modules) never imports TE or vLLM, and works without CUDA."""
    code = (
        "import sys\n"
        "import megatron_rlhf, megatron_rlhf.parallel.layout, megatron_rlhf.parallel.init, megatron_rlhf.models.spec\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('transformer_engine', 'vllm')]\n"
        "assert not bad, bad\n"
        "import torch; assert not torch.cuda.is_available()\n"
    )
    run_without_cuda(code)


def test_megatron_imports_without_the_compiler_stack_on_cpu():
    """parallel/eager_import.py: without CUDA, megatron-core's fusion helpers are not torch.compile-wrapped,
    so torch's dynamo/inductor are never imported; torch.compile itself is left as it was."""
    code = (
        "import sys, torch\n"
        "compile_ = torch.compile\n"
        "import megatron_rlhf\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_swiglu\n"
        "assert torch.compile is compile_\n"
        "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser\n"
        "assert not hasattr(fused_bias_swiglu.swiglu, '_torchdynamo_orig_callable'), 'compiled'\n"
        "assert 'torch._dynamo' not in sys.modules and 'torch._inductor.compile_fx' not in sys.modules\n"
    )
    run_without_cuda(code)
