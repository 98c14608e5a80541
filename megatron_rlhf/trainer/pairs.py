"""Preference pairs from two samples of the SFT policy per prompt, labelled by a gold scorer (default: the
tiny sort-digits task's true score).

The reward model should learn to rank what the policy actually produces, so its pairs are drawn
from the SFT policy itself (tiny-task.md): two samples per prompt, labelled by the noisy
Bradley-Terry rule on the true score (`sort_digits.label_pair`). The synthetic pairs written by
`prepare-tiny` only imitate that distribution.

::

    torchrun --nproc_per_node 2 -m megatron_rlhf.cli tiny-pairs --policy runs/tiny/sft/checkpoints \\
        --prompts runs/tiny/data/prompts.jsonl --tokenizer runs/tiny/data/tokenizer --num-pairs 8000 \\
        --out runs/tiny/data/sft_pairs.jsonl

Runs on any number of ranks with pp=1 (any tp). Each data-parallel rank samples a disjoint share of
the prompts; rank 0 gathers the rows and writes them in prompt order. Pair i uses prompt
``i % (number of prompts)``: asking for more pairs than the file has prompts reuses prompts with
fresh samples. A pair is sampled again (up to --max-tries rounds, then dropped; the summary counts
them) when it cannot be written (identical responses, or an empty one: the RM data loader rejects
both) or when the two true scores are equal (a coin-flip label, no preference: with the SFT policy
about 40% of first samples tie, which would cap held-out RM accuracy near 0.8; --keep-ties keeps them).

A response is its sampled tokens before the first EOS, as words; one that never emitted EOS within
--max-new-tokens is kept (all its --max-new-tokens words) and has true score -1
(`sort_digits.score_tokens`). The same seed, prompts
and layout (number of data-parallel ranks) give the same file.

Another task (``--gold-scorer module:function``, the `ppo.gold_scorer` contract: (prompt texts, response
texts) -> scores; e.g. ``megatron_rlhf.tasks.chat_sort:gold_scores``): prompts may be chat rows (``messages``,
rendered with the tokenizer's chat template and the generation prompt). A response is then its tokens before
the first EOS decoded as text; the scorer sees what the PPO stage gives it: the prompt decoded without special
tokens, the response with the EOS token's text appended when it emitted EOS. The rows' ``prompt`` is the
rendered prompt with its special tokens (chat markup), which the preference loader tokenizes back to the
same ids, so the reward model trains on the token sequences PPO will show it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rlhf.config.fields import ConfigError, load_gold_scorer
from megatron_rlhf.data.tokenizer import first_stop, stop_ids
from megatron_rlhf.tasks import sort_digits

Row = Dict[str, object]
TINY_SCORER = "megatron_rlhf.tasks.sort_digits:gold_scores"


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megatron-rlhf tiny-pairs",
        description="Preference pairs: two SFT-policy samples per prompt, labelled by the noisy Bradley-Terry "
        "rule on the true score (--gold-scorer; default the tiny task's). Run under torchrun (pp=1).",
    )
    p.add_argument("--policy", required=True, help="SFT training checkpoint (root with 'latest', or a step directory)")
    p.add_argument("--prompts", required=True, help="prompt-only jsonl (field 'prompt', or chat rows with 'messages')")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (prepare-tiny's tokenizer/, a converted checkpoint's)")
    # Not "--num": torchrun's parser would take it for an abbreviation of its own --numa-binding.
    p.add_argument("--num-pairs", type=int, required=True, help="pairs to write (prompt i %% len(prompts) for pair i)")
    p.add_argument("--out", required=True, help="output jsonl: prompt, chosen, rejected")
    p.add_argument("--seed", type=int, default=0, help="sampling and labelling seed")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (data-parallel = world / tp)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per generate call (2 samples each)")
    p.add_argument("--max-new-tokens", type=int, default=11, help="longest answer (7 digits) + 4")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the --policy checkpoint's generation_config.json, else 1.0)")
    p.add_argument("--max-tries", type=int, default=16,
                   help="rounds of resampling prompts whose two responses are identical, empty or tied in true score")
    p.add_argument("--sharpness", type=float, default=sort_digits.BT_SHARPNESS,
                   help="label noise: P(a chosen) = sigmoid(sharpness * (score_a - score_b)); 1e9 = noise-free labels")
    p.add_argument("--keep-ties", action="store_true",
                   help="also keep pairs with equal true scores (labelled by a coin flip)")
    p.add_argument("--gold-scorer", default=TINY_SCORER,
                   help="'module:function' (prompt texts, response texts) -> true scores, as ppo.gold_scorer "
                   "(default: the tiny task's; another one reads prompts as text or chat rows and responses as text)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if ":" not in args.gold_scorer:
        p.error(f"--gold-scorer {args.gold_scorer!r} must be 'module:function', e.g. {TINY_SCORER}")
    for name in ("num_pairs", "tp", "batch_size", "max_new_tokens", "max_tries"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature is not None and args.temperature <= 0:
        p.error(f"--temperature must be > 0, got {args.temperature} (greedy samples would always coincide)")
    return args


def sampling_temperature(args: argparse.Namespace) -> Optional[str]:
    """--temperature unless given: the --policy checkpoint's generation_config.json (config/generation.py), else
    1.0. Returns the line to log about it (None without a file)."""
    from megatron_rlhf.config import generation as G

    explicit = ["--temperature"] if args.temperature is not None else []
    if args.temperature is None:
        args.temperature = 1.0
    return G.apply_checkpoint_sampling(args, "--", G.find_generation_config(args.policy), explicit)


def response_text(ids: Sequence[int], stops: Sequence[int], tokenizer) -> Tuple[str, bool]:
    """Generated ids [n] (the sample's own tokens, filler cut off) -> (words before the first stop id (EOS, or
    any of the stop set `stop_ids`), finished = one was emitted). A special token the policy sampled
    mid-response (say <pad>) stays as its word: dropping it would change the response's true score and length."""
    ids, end = _until_stop(ids, stops)
    return " ".join(tokenizer.convert_ids_to_tokens(ids)), end is not None


def _until_stop(ids: Sequence[int], stops: Sequence[int]) -> Tuple[List[int], Optional[int]]:
    """(the ids before the first stop id, its index or None)."""
    ids = [int(i) for i in ids]
    end = first_stop(ids, stops)
    return (ids if end is None else ids[:end]), end


Response = Tuple[str, bool]  # (text, finished)


class Scoring:
    """How prompts and responses become text and true scores: the tiny task's words and true score, or
    text through the tokenizer and any gold scorer (`--gold-scorer`, see the module docstring)."""

    def __init__(self, spec: str, tokenizer):
        self.tiny, self.spec, self.tok = spec == TINY_SCORER, spec, tokenizer
        self.stops = stop_ids(tokenizer)
        self.fn, self._cache = None, {}
        if not self.tiny:
            self.fn = load_gold_scorer(spec, option="--gold-scorer ")

    def prompt(self, ids: Sequence[int]) -> str:
        """Prompt ids -> the text written in the rows: one the preference loader (which tokenizes it with the
        tokenizer's special tokens) turns back into `ids`. Chat markup stays (the rendered template); a BOS the
        tokenizer adds itself goes. Neither reproducing the ids (a template whose text does not re-tokenize to
        its ids) leaves the markup in."""
        ids = [int(i) for i in ids]
        if self.tiny:
            return self.tok.decode(ids, skip_special_tokens=True).strip()
        texts = (self.tok.decode(ids, skip_special_tokens=False), self.tok.decode(ids, skip_special_tokens=True).strip())
        return next((t for t in texts if list(self.tok(t, add_special_tokens=True)["input_ids"]) == ids), texts[0])

    def response(self, ids: Sequence[int]) -> Response:
        if self.tiny:
            return response_text(ids, self.stops, self.tok)
        ids, end = _until_stop(ids, self.stops)
        return self.tok.decode(ids, skip_special_tokens=False), end is not None

    def score(self, prompt: str, response: Response) -> float:
        if self.tiny:
            return sort_digits.true_score(prompt, response[0], response[1])
        key = (prompt, response)
        if key not in self._cache:
            # What PPO's gold scorer sees: the prompt without special tokens, the response with EOS when finished.
            plain = self.tok.decode(self.tok(prompt, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
            text = response[0] + (self.tok.eos_token if response[1] else "")
            try:
                value = float(list(self.fn([plain], [text]))[0])
            except Exception as e:  # noqa: BLE001 - any failure of user code, with the pair it failed on
                raise ConfigError(f"--gold-scorer {self.spec} failed on prompt {plain!r} (response {text!r}): "
                                 f"{type(e).__name__}: {e}: it must return one finite number per pair") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise ConfigError(f"--gold-scorer {self.spec} returned {value} for prompt {plain!r}: "
                                 "it must return one finite number per pair")
            self._cache[key] = value
        return self._cache[key]

    def usable(self, prompt: str, a: Response, b: Response, keep_ties: bool = False) -> bool:
        """Whether two responses make a preference row. Identical or empty ones (EOS right away) cannot
        be written: the RM data loader rejects them as malformed. Equal true scores (both dropped the last
        digit, say: common) carry no preference; the label is a coin flip that caps held-out accuracy."""
        if a[0] == b[0] or not a[0].strip() or not b[0].strip():
            return False
        return keep_ties or self.score(prompt, a) != self.score(prompt, b)


def _sample_round(policy, prompts, todo: List[int], args, tokenizer, vocab_size: int, generator,
                  scoring: Scoring) -> Dict[int, Tuple]:
    """Two samples for each pair index in `todo` -> {pair: (prompt, (text_a, fin_a), (text_b, fin_b))}."""
    from megatron_rlhf.rollout.megatron_engine import generate_for_prompts

    out = {}
    for start in range(0, len(todo), args.batch_size):
        pairs = todo[start : start + args.batch_size]
        examples = [prompts[i % len(prompts)] for i in pairs for _ in range(2)]  # rows 2k, 2k+1: pair k
        gen = generate_for_prompts(policy, examples, tokenizer, vocab_size=vocab_size,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   generator=generator)
        for k, i in enumerate(pairs):
            text = scoring.prompt(examples[2 * k]["prompt_ids"])
            # lengths cut off the pad filler generate() writes after a response ends.
            a, b = (scoring.response(gen["response_ids"][r, : int(gen["lengths"][r])].tolist()) for r in (2 * k, 2 * k + 1))
            out[i] = (text, a, b)
    return out


def _label(i: int, prompt: str, a: Response, b: Response, seed: int, sharpness: float, scoring: Scoring) -> Row:
    # One RNG per pair: the label of pair i does not depend on how pairs were split over ranks.
    rng = random.Random(f"{seed}/label/{i}")
    a_first = sort_digits.prefer_first(scoring.score(prompt, a), scoring.score(prompt, b), rng, sharpness)
    chosen, rejected = (a[0], b[0]) if a_first else (b[0], a[0])
    return {"index": i, "row": {"prompt": prompt, "chosen": chosen, "rejected": rejected},
            "unfinished": int(not a[1]) + int(not b[1])}


def _write_jsonl(path: str, rows: Sequence[Row]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, path)  # readers never see a half-written file


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    from megatron.core import parallel_state as ps

    from megatron_rlhf.config import model_file
    from megatron_rlhf.config import schema as C
    from megatron_rlhf.data import dataset as D
    from megatron_rlhf.data import tokenizer as T
    from megatron_rlhf.checkpoint import state as ckpt
    from megatron_rlhf.parallel import init
    from megatron_rlhf.parallel.layout import ParallelConfig, validate_layout

    note = sampling_temperature(args)
    model_cfg = model_file.read_model_config(args.policy)
    if model_cfg is None:
        raise ckpt.CheckpointError(
            f"--policy {args.policy}: no model_config.json found: pass the checkpoint root of an SFT run"
        )
    parallel = ParallelConfig(tp=args.tp)
    world = init.world_size_from_env()
    validate_layout(parallel, world, num_layers=model_cfg.num_layers,
                    num_attention_heads=model_cfg.num_attention_heads, num_query_groups=model_cfg.num_query_groups)
    init.initialize(parallel, seed=args.seed)
    try:
        rank0 = torch.distributed.get_rank() == 0
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        if rank0 and note:
            print(note, flush=True)
        tokenizer = T.load_tokenizer(args.tokenizer)
        T.check_vocab(tokenizer, model_cfg.vocab_size)
        scoring = Scoring(args.gold_scorer, tokenizer)
        # Prompts longer than the model can continue by max_new_tokens are dropped (the load report says so).
        data_cfg = C.DataConfig(train_path=args.prompts, overlong="drop",
                                max_seq_len=model_cfg.max_position_embeddings - args.max_new_tokens + 1)
        prompts, _ = D.load_examples("prompt", data_cfg, tokenizer, log=print if rank0 else None)
        policy = ckpt.load_model(args.policy, model_cfg, parallel, "policy", "lm", key="--policy",
                                 tokenizer=T.fingerprint(tokenizer))

        # Same seed on the TP ranks of one data-parallel rank (they must decode the same tokens),
        # different seeds across data-parallel ranks (disjoint prompts, independent samples).
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dp_rank)
        todo = list(range(args.num_pairs))[dp_rank::dp_size]
        mine: List[Row] = []
        first_differ = 0  # pairs of the first round with different true scores: the policy's diversity
        for round_ in range(args.max_tries):
            if not todo:
                break
            sampled = _sample_round(policy, prompts, todo, args, tokenizer, model_cfg.vocab_size, generator, scoring)
            if round_ == 0:
                first_differ = sum(scoring.score(p, a) != scoring.score(p, b) for p, a, b in sampled.values())
            retry = {i for i in todo if not scoring.usable(*sampled[i], keep_ties=args.keep_ties)}
            mine += [_label(i, *sampled[i], args.seed, args.sharpness, scoring) for i in todo if i not in retry]
            todo = [i for i in todo if i in retry]
        stats = (len(todo), first_differ)

        # Rank 0 collects; TP ranks other than the first hold copies of their group's rows.
        contribution = (mine, stats) if ps.get_tensor_model_parallel_rank() == 0 else ([], (0, 0))
        gathered = [None] * world if rank0 else None
        torch.distributed.gather_object(contribution, gathered, dst=0)
        if rank0:
            labelled = sorted((r for rows, _ in gathered for r in rows), key=lambda r: r["index"])
            n_dropped = sum(s[0] for _, s in gathered)
            differ = sum(s[1] for _, s in gathered) / args.num_pairs
            _write_jsonl(args.out, [r["row"] for r in labelled])
            unfinished = sum(r["unfinished"] for r in labelled) / max(2 * len(labelled), 1)
            print(
                f"tiny-pairs: wrote {len(labelled)} pairs to {args.out} ({n_dropped} dropped: no usable pair in "
                f"{args.max_tries} tries) | first samples: true scores differ in {differ:.3f} of pairs | "
                f"responses without EOS (truncated) in the file: {unfinished:.3f}",
                flush=True,
            )
        torch.distributed.barrier()
    finally:
        init.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
