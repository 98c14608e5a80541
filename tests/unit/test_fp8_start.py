"""FP8 is on only with CUDA and Transformer Engine: anywhere else a stage stops at start with one line,
never a silent bf16 run (the layout check itself: tests/unit/test_layout.py)."""

import os
import subprocess
import sys

import pytest

from megatron_rlhf.models.spec import layer_spec
from megatron_rlhf.parallel.layout import LayoutError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fp8_layer_spec_needs_transformer_engine():
    with pytest.raises(LayoutError, match="FP8 needs the Transformer Engine layer spec") as e:
        layer_spec(te=True)  # what build_model asks for when fp8.format is set
    assert "\n" not in str(e.value)


def test_fp8_stage_without_cuda_stops_at_start_with_one_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "tok").mkdir()
    argv = [sys.executable, "-m", "megatron_rlhf.cli", "sft", f"data.train_path={data}", f"tokenizer.path={tmp_path / 'tok'}",
            f"logging.run_dir={tmp_path / 'run'}", "fp8.format=hybrid"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: fp8.format='hybrid' needs CUDA, and none is available: set fp8.format=null"]
