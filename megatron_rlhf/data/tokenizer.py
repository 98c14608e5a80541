"""The tokenizer of a run: loaded from a local HF directory, checked against the model, and fingerprinted.

A checkpoint records the fingerprint of the tokenizer it was trained with (`fingerprint`, kept in the step's
run.json by checkpoint/state.py), so a later stage that loads it with another tokenizer is refused: a
permuted vocabulary of the right size, or a smaller one whose ids shift, would otherwise train and score
on token ids that mean other words, with no error.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Optional, Sequence, Tuple, Union


class DataError(ValueError):
    """Unusable data or tokenizer. The message is one line naming the file, the numbers and the fix."""


# Classes that AutoTokenizer resolves to the generic fast tokenizer (`tokenizer.json` read by `tokenizers`):
# named directly, they load the same tokenizer without importing AutoTokenizer's mapping of every model,
# about 1 s of each rank's start-up on the 2-core machine (torch's compiler stack comes with it).
GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str, key: str = "tokenizer.path"):
    """A local HF tokenizer (no hub access). A missing pad token falls back to EOS: collate never
    relies on the pad id to find real tokens (it uses lengths), so this is safe. `key`: the setting, for errors."""
    if not os.path.isdir(path):
        raise DataError(f"{key}: '{path}' is not a directory holding an HF tokenizer")
    if _tokenizer_class(path) in GENERIC_FAST and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    try:
        tok = tokenizer_class.from_pretrained(path, local_files_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{key}: could not load a tokenizer from '{path}': {first}") from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def _tokenizer_class(path: str):
    """The class a tokenizer directory's tokenizer_config.json names (None if it names none or cannot be read:
    AutoTokenizer then decides, and reports what is wrong)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def check_vocab(tokenizer, vocab_size: int, model: str = "model") -> None:
    """`DataError` if the tokenizer can produce ids the model has no embedding for (`model`: which, for errors)."""
    if len(tokenizer) > vocab_size:
        raise DataError(
            f"tokenizer has {len(tokenizer)} tokens but {model}.vocab_size={vocab_size}: use the model's tokenizer"
        )


def require_eos(tokenizer, stage: str) -> None:
    """Stages that generate end each response at EOS: without one every response runs to the length limit
    and is penalised as truncated (truncation rate 1.0 from the first iteration)."""
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"tokenizer.path: the tokenizer at '{tokenizer.name_or_path}' has no EOS token, and {stage} ends "
            "every response at EOS (without one each response is cut at the length limit and penalised): "
            "use a tokenizer with an eos_token (set it in its tokenizer_config.json)")


def stop_ids(tokenizer) -> Tuple[int, ...]:
    """The ids a response ends at: the tokenizer's EOS first, then every `eos_token_id` of the
    `generation_config.json` beside the tokenizer (an id or a list: Llama-3.1-Instruct lists 128001, 128008 and
    128009; Gemma adds `<end_of_turn>`, Phi-3 `<|end|>`). () without either. The sampler, vLLM, the missing-EOS
    penalty, sampled preference pairs and chat preference rows all end responses at this set."""
    eos = tokenizer.eos_token_id
    listed = _generation_eos(str(getattr(tokenizer, "name_or_path", "") or ""))
    out = ([] if eos is None else [int(eos)]) + [i for i in listed if i != eos]
    return tuple(dict.fromkeys(out))


def _generation_eos(directory: str) -> Tuple[int, ...]:
    path = os.path.join(directory, "generation_config.json")
    if not directory or not os.path.isfile(path):
        return ()
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()  # config/generation.py reports an unreadable file where the run reads its sampling
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def stop_set(eos: Union[None, int, Sequence[int]]) -> Tuple[int, ...]:
    """An engine's `eos_id` argument (None, one id, or the stop set) -> the tuple of stop ids."""
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(i) for i in eos)


def first_stop(ids: Sequence[int], stops: Sequence[int]) -> Optional[int]:
    """The index of the first id of `ids` in the stop set `stops`, or None."""
    return next((i for i, t in enumerate(ids) if t in stops), None)


def fingerprint(tokenizer) -> Dict[str, Any]:
    """What a checkpoint records of its tokenizer: the directory it came from, its size, a hash of the
    vocabulary (every token -> id, added tokens included) and the special tokens with their ids. Two
    tokenizers with equal `vocab` and `special` map every token to the same id."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    special = {}
    for name, token in sorted(tokenizer.special_tokens_map.items()):
        tokens = token if isinstance(token, list) else [token]
        special[name] = [[str(t), tokenizer.convert_tokens_to_ids(str(t))] for t in tokens]
    return {"path": os.path.abspath(str(tokenizer.name_or_path)), "size": len(tokenizer),
            "vocab": hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16], "special": special}

