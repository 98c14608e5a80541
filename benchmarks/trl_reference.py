"""The reference library on the reference shape: TRL's PPOTrainer (`trl.experimental.ppo`, TRL 1.0-1.12;
later TRL releases dropped PPO), same model shape, prompts, lengths, batch split and threads as
`ppo_iteration.py`, so the two figures can be compared side by side in one run.

    pip install "trl==1.12.0"     # e.g. into a venv made with --system-site-packages
    python benchmarks/ppo_iteration.py    # runs this part too when trl's PPO is importable

TRL's iteration differs from ours in ways that favour it: its old logprobs come from `generate`'s scores
(no recomputation forward), and it trains policy and value with one combined backward and one optimizer
step per minibatch. Its models: `LlamaForCausalLM` (policy, reference) and `LlamaForSequenceClassification`
(reward, value) with the shape below; responses never end early (no EOS id). With CUDA it runs on the GPU,
as ours does there.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch


def available() -> bool:
    try:
        from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: F401
    except Exception:  # ImportError, or a TRL whose experimental package fails to import here
        return False
    return True


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                  pad_token="t0", unk_token="t1",
                                  eos_token=f"t{vocab_size - 1}")  # TRL counts EOS tokens; generation ignores it
    tok.padding_side = "left"
    return tok


def seconds_per_iteration(shape: dict, prompts: int, minibatches: int, epochs: int, new_tokens: int,
                          repeats: int, prompt_ids: list, bf16: bool = False, between=None) -> tuple:
    """(median seconds per PPO update, every update's seconds) over `repeats` updates after one warm-up.

    `shape`: benchmarks/shapes.py's dict (optional rotary_base, tie_embeddings). `bf16`: TRL's own bf16 mode
    (`PPOConfig(bf16=True)`: accelerate's autocast over fp32 weights). `between()`, when given, runs after each
    update, off the clock (the other side of a comparison, interleaved with TRL's updates)."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from machine import sync  # benchmarks/ is on sys.path: this module runs from ppo_iteration.py or as a script

    cfg = LlamaConfig(hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"],
                      num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
                      num_key_value_heads=shape["num_query_groups"], vocab_size=shape["vocab_size"],
                      max_position_embeddings=shape["max_position_embeddings"], pad_token_id=0,
                      eos_token_id=None, bos_token_id=None, num_labels=1,
                      rope_theta=shape.get("rotary_base", 10000.0),
                      tie_word_embeddings=shape.get("tie_embeddings", False))
    torch.manual_seed(0)
    policy, reference = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    reward, value = LlamaForSequenceClassification(cfg), LlamaForSequenceClassification(cfg)
    for m in (policy, reference):
        m.generation_config.eos_token_id = None  # never end early, as in our benchmark
        m.generation_config.pad_token_id = 0
    dataset = Dataset.from_dict({"input_ids": [list(p) for p in prompt_ids]})
    starts, ends = [], []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sync()  # the update's queued GPU work counts
            ends.append(time.perf_counter())
            if between is not None:
                threads = torch.get_num_threads()
                torch.set_num_threads(2)
                between()
                torch.set_num_threads(threads)
            starts.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        # TRL: rollout batch = per_device_train_batch_size x accumulation; minibatch = that / num_mini_batches
        args = PPOConfig(output_dir=out, per_device_train_batch_size=prompts,
                         gradient_accumulation_steps=1, num_mini_batches=minibatches, num_ppo_epochs=epochs,
                         response_length=new_tokens, local_rollout_forward_batch_size=prompts,
                         total_episodes=prompts * (repeats + 1), stop_token=None, missing_eos_penalty=None,
                         temperature=1.0, learning_rate=1e-5, num_sample_generations=0, report_to=[],
                         save_strategy="no", logging_steps=1000, use_cpu=not torch.cuda.is_available(), bf16=bf16,
                         fp16=False, dataloader_drop_last=True, seed=0)
        trainer = PPOTrainer(args=args, processing_class=_tokenizer(shape["vocab_size"]), model=policy,
                             ref_model=reference, reward_model=reward, train_dataset=dataset, value_model=value,
                             callbacks=[Stamp()])
        torch.set_num_threads(2)
        starts.append(time.perf_counter())
        trainer.train()
    times = [b - a for a, b in zip(starts, ends)][1:]  # drop the warm-up update
    return statistics.median(times), times


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from shapes import EPOCHS, MINIBATCHES, PROMPTS, SHAPE, random_prompts

    ids, mask = random_prompts()
    rows = [ids[i][mask[i]].tolist() for i in range(PROMPTS)]
    print(seconds_per_iteration(SHAPE, PROMPTS, MINIBATCHES, EPOCHS, 64, 5, rows))
