"""FP8 is on only with CUDA and Transformer Engine: anywhere else a stage stops at start with one line,
never a silent bf16 run (the layout check itself: tests/unit/test_layout.py)."""

import pytest
import torch

from megatron_rlhf import cli
from megatron_rlhf.models.spec import layer_spec
from megatron_rlhf.parallel.layout import LayoutError


def test_fp8_layer_spec_needs_transformer_engine():
    with pytest.raises(LayoutError, match="FP8 needs the Transformer Engine layer spec") as e:
        layer_spec(te=True)  # what build_model asks for when fp8.format is set
    assert "\n" not in str(e.value)


def test_fp8_stage_without_cuda_stops_at_start_with_one_line(tmp_path, capsys, monkeypatch):
    """The real `sft` command (in process): the layout check runs before any process group or model."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on every CPU machine
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "tok").mkdir()
    argv = ["sft", f"data.train_path={data}", f"tokenizer.path={tmp_path / 'tok'}",
            f"logging.run_dir={tmp_path / 'run'}", "fp8.format=hybrid"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == "error: fp8.format='hybrid' needs CUDA, and none is available: set fp8.format=null\n"
    assert not torch.distributed.is_initialized()
