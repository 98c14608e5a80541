"""GGUF files (llama.cpp's format) -> a plain Hugging Face directory, for `hf_to_megatron`.

    convert_hf_to_megatron.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR [--dtype float32]

transformers reads the file (`from_pretrained(dir, gguf_file=...)`, with the `gguf` package) and
dequantises every tensor to the dtype asked for; the model is then saved as a plain safetensors
directory (the GGUF quantisation config dropped, which `save_pretrained` would refuse) together with
the tokenizer that the file carries (vocabulary, special tokens, chat template). That directory is what
`hf_to_megatron` converts, so the Megatron checkpoint carries the tokenizer and its chat template too.

The whole model is dequantised in host memory (fp32: 4 bytes per parameter). Tensor types are checked
first, from the file's header: a quantisation that the `gguf` package cannot dequantise is one error
line before anything is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from megatron_rlhf.models.hf_mapping import ConversionError

DTYPES = ("float32", "bfloat16", "float16")


def check_gguf(path: Path) -> None:
    """One-line ConversionError for a missing file, a non-GGUF file, or a tensor type that cannot be dequantised."""
    try:
        import gguf
        from gguf.quants import _type_traits
    except ImportError:
        raise ConversionError("--gguf needs the gguf package: pip install gguf accelerate") from None
    if not path.is_file():
        raise ConversionError(f"--gguf {path} does not exist: pass a .gguf file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # a wrong magic number, a truncated header: what GGUFReader raises varies
        raise ConversionError(f"--gguf {path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype not in plain and qtype not in _type_traits:
            raise ConversionError(
                f"--gguf {path}: tensor {t.name} is quantised as {qtype.name}, which the gguf package cannot "
                "dequantise: convert a GGUF of another quantisation (e.g. Q8_0, Q4_K_M or F16)")


@contextlib.contextmanager
def gguf_as_hf_dir(path: str, dtype: Optional[str], scratch: Optional[Path] = None,
                   progress: bool = True) -> Iterator[Path]:
    """Yield a temporary HF directory (config.json, safetensors, tokenizer files) holding the GGUF model.

    dtype: the dtype the tensors are dequantised to (default float32). scratch: where the temporary
    directory goes (next to the output keeps it on the same disk); removed on exit. progress=False
    (`--quiet`): transformers' progress bars stay off while it reads the file and writes the copy."""
    path = Path(path)
    check_gguf(path)
    dtype = dtype or "float32"
    if dtype not in DTYPES:
        raise ConversionError(f"unsupported dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    import torch
    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=scratch))
    try:
        with contextlib.nullcontext() if progress else _no_transformers_progress():
            try:
                config, model, tokenizer = _load(path, dtype, dict(gguf_file=path.name))
            except (ValueError, NotImplementedError, KeyError, OSError) as e:
                raise ConversionError(f"--gguf {path}: transformers cannot load it ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
            # save_pretrained refuses a GGUF-quantised model; the dequantised tensors in a plain model save fine.
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
            plain.load_state_dict(model.state_dict())
            plain.generation_config = model.generation_config
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            del model, plain
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load(path: Path, dtype: str, kw: dict):
    """(config, model, tokenizer) as transformers reads them from the GGUF file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=getattr(torch, dtype), **kw)
    return config, model, AutoTokenizer.from_pretrained(path.parent, **kw)


@contextlib.contextmanager
def _no_transformers_progress():
    """transformers' own bars follow `disable_progress_bar`; its GGUF reader calls tqdm directly, so that
    module's `tqdm` is swapped for a disabled one meanwhile."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled, bar = hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()
