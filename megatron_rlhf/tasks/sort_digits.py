"""The tiny RLHF task: sort 3-7 digits (see /work/shared/reference/tiny-task.md).

Prompt ``<bos> sort d1 ... dn =``; the answer is the sorted digits then ``<eos>``. The true score of a
response is ``1 - levenshtein(response, target) / n`` floored at -1, and -1 without EOS. Demonstrations
are deliberately imperfect (60% drop the last element, 40% get 1-2 random edits), so SFT alone
plateaus and PPO against a reward model has something to gain.

Everything here is offline and deterministic given a seed: the 17-token word-level tokenizer (built
with `tokenizers`, wrapped as `PreTrainedTokenizerFast`), demonstration/prompt/preference jsonl files,
the true score, the Bradley-Terry noisy labeller for pairs of policy samples, and a fallback generator
of synthetic preference pairs so the RM stage can run without sampling.

Response text in the files never contains ``<eos>``: `data.append_eos=true` appends it.

CLI: ``megatron-rlhf prepare-tiny OUT_DIR [--seed S]`` (or ``python -m megatron_rlhf.tasks.sort_digits``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from typing import Dict, List, Optional, Sequence, Tuple

SPECIAL = ["<pad>", "<bos>", "<eos>"]
OPS = ["sort", "rev", "copy"]
VOCAB = SPECIAL + OPS + ["="] + [str(d) for d in range(10)]  # 17 tokens; id = position
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MIN_DIGITS, MAX_DIGITS = 3, 7
BT_SHARPNESS = 10.0  # label noise: P(a preferred) = sigmoid(10 * (score_a - score_b))


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def build_tokenizer():
    """The 17-token word-level tokenizer; prompts get ``<bos>`` prepended (add_special_tokens=True).

    Left padding, since its main use is batched generation.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # No unknown token: an out-of-vocabulary word is an error, never silently mapped.
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=64,
    )


def save_tokenizer(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    build_tokenizer().save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------


def make_prompt(digits: Sequence[int], op: str = "sort") -> str:
    """Prompt text without ``<bos>`` (the tokenizer adds it)."""
    return " ".join([op, *map(str, digits), "="])


def parse_prompt(prompt: str) -> Tuple[str, List[int]]:
    """(op, digits) from prompt text, with or without ``<bos>``."""
    words = [w for w in prompt.split() if w != "<bos>"]
    if len(words) < 2 or words[0] not in OPS or words[-1] != "=":
        raise ValueError(f"not a task prompt: {prompt!r}")
    return words[0], [int(w) for w in words[1:-1]]


def target(op: str, digits: Sequence[int]) -> List[int]:
    if op == "sort":
        return sorted(digits)
    if op == "rev":
        return list(reversed(digits))
    if op == "copy":
        return list(digits)
    raise ValueError(f"unknown op {op!r}")


def random_digits(rng: random.Random) -> List[int]:
    return [rng.randrange(10) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]


def random_edit(seq: List[int], rng: random.Random) -> List[int]:
    """One random substitute / delete / duplicate / swap."""
    seq = list(seq)
    kind = rng.choice(["substitute", "delete", "duplicate", "swap"])
    i = rng.randrange(len(seq))
    if kind == "substitute":
        seq[i] = rng.choice([d for d in range(10) if d != seq[i]])
    elif kind == "delete" and len(seq) > 1:
        del seq[i]
    elif kind == "duplicate":
        seq.insert(i, seq[i])
    elif len(seq) > 1:  # swap with a neighbour (a one-element list is left as is)
        j = i + 1 if i + 1 < len(seq) else i - 1
        seq[i], seq[j] = seq[j], seq[i]
    return seq


def demonstrate(digits: Sequence[int], rng: random.Random, op: str = "sort") -> List[int]:
    """The imperfect demonstrator: 60% drop the last element, 40% apply 1-2 random edits."""
    answer = target(op, digits)
    if rng.random() < 0.6:
        return answer[:-1]
    for _ in range(rng.randint(1, 2)):
        answer = random_edit(answer, rng)
    return answer


def levenshtein(a: Sequence, b: Sequence) -> int:
    """Edit distance (insert, delete, substitute all cost 1)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def score_tokens(op: str, digits: Sequence[int], response: Sequence[str], finished: bool) -> float:
    """True score of response words (tokens before EOS): ``max(-1, 1 - lev / n)``, -1 if not finished."""
    if not finished:
        return -1.0
    want = [str(d) for d in target(op, digits)]
    return max(-1.0, 1.0 - levenshtein(list(response), want) / len(digits))


def true_score(prompt: str, response: str, finished: Optional[bool] = None) -> float:
    """True score of a response text. A ``<eos>`` word ends the response (the rest is ignored) and
    marks it finished; without one, `finished` decides (default False: a sample that never emitted
    EOS). Response texts from the data files have no ``<eos>``: pass ``finished=True`` for them."""
    op, digits = parse_prompt(prompt)
    words = response.split()
    if "<eos>" in words:
        words, finished = words[: words.index("<eos>")], True
    return score_tokens(op, digits, words, bool(finished))


def true_score_ids(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
    """True score from token ids (padding excluded); finished iff the response contains EOS."""
    prompt = " ".join(VOCAB[i] for i in prompt_ids if i != PAD_ID)
    response = [int(i) for i in response_ids]
    finished = EOS_ID in response
    if finished:
        response = response[: response.index(EOS_ID)]
    op, digits = parse_prompt(prompt)
    return score_tokens(op, digits, [VOCAB[i] for i in response], finished)


def gold_scores(prompts: Sequence[str], responses: Sequence[str]) -> List[float]:
    """The PPO stage's gold scorer for this task (`ppo.gold_scorer: megatron_rlhf.tasks.sort_digits:gold_scores`):
    true scores of response texts, which carry ``<eos>`` when the response finished."""
    return [true_score(p, r) for p, r in zip(prompts, responses)]


def label_pair(
    prompt: str,
    response_a: str,
    response_b: str,
    rng: random.Random,
    finished_a: bool = True,
    finished_b: bool = True,
    sharpness: float = BT_SHARPNESS,
) -> Tuple[str, str]:
    """(chosen, rejected): a is preferred with probability sigmoid(sharpness * (s_a - s_b))."""
    a_first = prefer_first(true_score(prompt, response_a, finished_a), true_score(prompt, response_b, finished_b),
                           rng, sharpness)
    return (response_a, response_b) if a_first else (response_b, response_a)


def prefer_first(score_a: float, score_b: float, rng: random.Random, sharpness: float = BT_SHARPNESS) -> bool:
    """The Bradley-Terry noisy label: True (a chosen) with probability sigmoid(sharpness * (score_a - score_b));
    one draw of `rng`."""
    z = sharpness * (score_a - score_b)
    p_a = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))  # no overflow
    return rng.random() < p_a


def _words(seq: Sequence[int]) -> str:
    return " ".join(map(str, seq))


def sample_response(digits: Sequence[int], rng: random.Random, p_correct: float = 0.25) -> List[int]:
    """A stand-in for an SFT-policy sample: the correct answer with probability p_correct, else a
    demonstration (the policy imitates the demonstrator, improving on it only sometimes)."""
    if rng.random() < p_correct:
        return target("sort", digits)
    return demonstrate(digits, rng)


def synthetic_pairs(num: int, rng: random.Random) -> List[Dict[str, str]]:
    """Preference rows from perturbed demonstrations, labelled by the Bradley-Terry noisy rule
    (the fallback when no SFT policy samples are available)."""
    rows = []
    while len(rows) < num:
        digits = random_digits(rng)
        a, b = sample_response(digits, rng), sample_response(digits, rng)
        if a == b:
            continue  # no preference signal
        prompt = make_prompt(digits)
        chosen, rejected = label_pair(prompt, _words(a), _words(b), rng)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def demonstrations(num: int, rng: random.Random) -> List[Dict[str, str]]:
    rows = []
    for _ in range(num):
        digits = random_digits(rng)
        rows.append({"prompt": make_prompt(digits), "response": _words(demonstrate(digits, rng))})
    return rows


def prompts(num: int, rng: random.Random) -> List[Dict[str, str]]:
    return [{"prompt": make_prompt(random_digits(rng))} for _ in range(num)]


def _write_jsonl(path: str, rows: Sequence[Dict]) -> str:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def write_tiny_task(
    out_dir: str,
    seed: int = 0,
    num_sft: int = 20000,
    num_sft_eval: int = 500,
    num_pairs: int = 8000,
    num_pairs_eval: int = 1000,
    num_prompts: int = 20000,
    num_prompts_eval: int = 500,
) -> Dict[str, str]:
    """Write the tokenizer and the jsonl files of the task; returns {name: path}.

    Each file has its own random stream (derived from `seed` and its name), so changing one count
    does not change the other files.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {"tokenizer": save_tokenizer(os.path.join(out_dir, "tokenizer"))}
    plan = [
        ("sft", demonstrations, num_sft),
        ("sft_eval", demonstrations, num_sft_eval),
        ("pairs", synthetic_pairs, num_pairs),
        ("pairs_eval", synthetic_pairs, num_pairs_eval),
        ("prompts", prompts, num_prompts),
        ("prompts_eval", prompts, num_prompts_eval),
    ]
    for name, make, num in plan:
        rng = random.Random(f"{seed}/{name}")
        paths[name] = _write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), make(num, rng))
    meta = {"task": "sort_digits", "seed": seed, "vocab": VOCAB, "files": paths}
    with open(os.path.join(out_dir, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rlhf prepare-tiny",
        description="Write the tiny sort-digits task: tokenizer/ and sft, pairs, prompts jsonl files (+ _eval).",
    )
    parser.add_argument("out_dir", help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-sft", type=int, default=20000, help="demonstrations")
    parser.add_argument("--num-pairs", type=int, default=8000, help="synthetic preference pairs")
    parser.add_argument("--num-prompts", type=int, default=20000, help="prompt-only rows (PPO)")
    args = parser.parse_args(argv)
    paths = write_tiny_task(
        args.out_dir, seed=args.seed, num_sft=args.num_sft, num_pairs=args.num_pairs, num_prompts=args.num_prompts
    )
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
