"""The tiny task's digit sorting asked in words through a chat template: the task of the real-model recipe
(examples/smollm2/).

A prompt row is ``{"messages": [{"role": "system", "content": INSTRUCTION},
{"role": "user", "content": "Sort these digits in ascending order: 7 3 9 1."}]}``; the stages render it
with the checkpoint tokenizer's chat template and the generation prompt. The digits (3-7, drawn with
replacement) come from `sort_digits.random_digits`, so the two tasks ask the same questions.

Gold score of an answer (`gold_scores`, usable as ``ppo.gold_scorer: megatron_rlhf.tasks.chat_sort:gold_scores``
and ``tiny-pairs --gold-scorer``): the tiny task's true score (`sort_digits.score_tokens`:
``max(-1, 1 - levenshtein(answer digits, sorted digits) / n)``, -1 without EOS) of the digits parsed from the
answer text. The parsing rule, exactly:

* the question's digits are the single digits after the LAST ``Sort these digits in ascending order:`` in the
  prompt text (a system prompt or chat markup before it is ignored);
* the answer ends at the first EOS text (``<|im_end|>`` by default: what the PPO stage leaves at the end of a
  response that emitted EOS); an answer without it did not finish and scores -1;
* the answer's digits are ALL digit characters ``0-9`` in the answer, in order, each one on its own: "1 3 7 9",
  "1, 3, 7, 9" and "1379" all read as [1, 3, 7, 9], and every other character is ignored.

Why every digit character: the format (spaces, commas, brackets) is not what is being judged, so any
separator is free; but a digit anywhere in the answer counts, so chatter that carries numbers ("there are 4
digits: 1 3 7 9") is an edit away from the target and costs score, as a wrong digit does. Numbers of several
digits are read as their digits ("13" = 1, 3): the question only ever holds single digits.

CLI: ``megatron-rlhf prepare-chat-sort OUT_DIR [--seed S]`` writes sft.jsonl and sft_eval.jsonl (chat rows with
the tiny task's imperfect demonstrations as the assistant turn), prompts.jsonl and prompts_eval.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_rlhf.tasks import sort_digits

QUESTION = "Sort these digits in ascending order:"
INSTRUCTION = "Answer with the sorted digits only, separated by spaces."
EOS_TEXT = "<|im_end|>"  # SmolLM2's (ChatML) end of turn; gold_scores(eos_text=...) for another template
_QUESTION_RE = re.compile(re.escape(QUESTION) + r"((?:\s*\d(?!\d))+)")
_DIGIT_RE = re.compile(r"[0-9]")


def question(digits: Sequence[int]) -> str:
    """'Sort these digits in ascending order: 7 3 9 1.'"""
    return f"{QUESTION} {' '.join(map(str, digits))}."


def make_messages(digits: Sequence[int], instruction: Optional[str] = INSTRUCTION) -> List[Dict[str, str]]:
    """Chat messages of one prompt: the instruction as the system turn (none: the template's default), then
    the question."""
    system = [{"role": "system", "content": instruction}] if instruction else []
    return system + [{"role": "user", "content": question(digits)}]


def prompt_digits(prompt: str) -> List[int]:
    """The digits of the last question in a prompt text (rendered, with or without chat markup)."""
    found = _QUESTION_RE.findall(prompt)
    if not found:
        raise ValueError(f"not a chat-sort prompt (no {QUESTION!r} followed by digits): {prompt[-120:]!r}")
    return [int(d) for d in _DIGIT_RE.findall(found[-1])]


def answer_digits(response: str, eos_text: str = EOS_TEXT) -> Tuple[List[int], bool]:
    """(digits of the answer before the first `eos_text`, finished = `eos_text` was there)."""
    finished = eos_text in response
    if finished:
        response = response[: response.index(eos_text)]
    return [int(d) for d in _DIGIT_RE.findall(response)], finished


def true_score(prompt: str, response: str, eos_text: str = EOS_TEXT) -> float:
    """The tiny task's true score of the digits parsed from `response` (see the module docstring)."""
    digits = prompt_digits(prompt)
    answer, finished = answer_digits(response, eos_text)
    return sort_digits.score_tokens("sort", digits, [str(d) for d in answer], finished)


def gold_scores(prompts: Sequence[str], responses: Sequence[str], eos_text: str = EOS_TEXT) -> List[float]:
    """[n] prompt texts, [n] response texts (ending in `eos_text` when finished) -> [n] gold scores."""
    return [true_score(p, r, eos_text) for p, r in zip(prompts, responses)]


def prompt_rows(num: int, rng: random.Random, instruction: Optional[str] = INSTRUCTION) -> List[Dict]:
    return [{"messages": make_messages(sort_digits.random_digits(rng), instruction)} for _ in range(num)]


def demonstration_rows(num: int, rng: random.Random, instruction: Optional[str] = INSTRUCTION) -> List[Dict]:
    """Chat rows whose assistant turn is the tiny task's imperfect demonstrator's answer (`sort_digits.demonstrate`:
    60% drop the last digit, 40% get 1-2 random edits), digits separated by spaces: SFT on them teaches the
    answer format and leaves PPO the same room to improve as on the tiny task."""
    rows = []
    for _ in range(num):
        digits = sort_digits.random_digits(rng)
        answer = " ".join(map(str, sort_digits.demonstrate(digits, rng)))
        rows.append({"messages": make_messages(digits, instruction) + [{"role": "assistant", "content": answer}]})
    return rows


def write_task(out_dir: str, seed: int = 0, num_prompts: int = 20000, num_prompts_eval: int = 500,
               instruction: Optional[str] = INSTRUCTION, num_sft: int = 2000, num_sft_eval: int = 200) -> Dict[str, str]:
    """sft.jsonl, sft_eval.jsonl (demonstrations), prompts.jsonl and prompts_eval.jsonl under `out_dir`, each
    from its own seeded stream; returns {name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    plan = (("sft", demonstration_rows, num_sft), ("sft_eval", demonstration_rows, num_sft_eval),
            ("prompts", prompt_rows, num_prompts), ("prompts_eval", prompt_rows, num_prompts_eval))
    for name, make, num in plan:
        rows = make(num, random.Random(f"{seed}/chat_sort/{name}"), instruction)
        path = paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with open(path + ".tmp", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(path + ".tmp", path)  # a killed run leaves no half file
    with open(os.path.join(out_dir, "meta.json"), "w") as fh:
        json.dump({"task": "chat_sort", "seed": seed, "instruction": instruction, "files": paths}, fh, indent=2)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-rlhf prepare-chat-sort",
                                description="Write the chat digit-sorting task: sft.jsonl, sft_eval.jsonl, prompts.jsonl, prompts_eval.jsonl.")
    p.add_argument("out_dir", help="output directory (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-sft", type=int, default=2000, help="demonstrations (SFT on the answer format)")
    p.add_argument("--num-prompts", type=int, default=20000, help="training prompts (pairs, PPO)")
    p.add_argument("--num-prompts-eval", type=int, default=500, help="held-out prompts (RM eval pairs, PPO eval)")
    p.add_argument("--instruction", default=INSTRUCTION, help="system turn of every prompt ('' = the template's default)")
    args = p.parse_args(argv)
    for name in ("num_sft", "num_prompts", "num_prompts_eval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name, path in write_task(args.out_dir, args.seed, args.num_prompts, args.num_prompts_eval,
                                 args.instruction or None, num_sft=args.num_sft).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
