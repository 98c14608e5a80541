#!/usr/bin/env bash
# The tiny CPU pipeline on 2 gloo ranks: data -> SFT -> preference pairs sampled from the SFT
# policy -> reward model (+ reward calibration).
# Extra arguments are config overrides applied to both stages, e.g. train.train_steps=50.
# Runs resume where they stopped (checkpoints under runs/tiny/); delete runs/tiny to start over.
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f runs/tiny/data/meta.json ] || megatron-rlhf prepare-tiny runs/tiny/data
megatron-rlhf launch --nproc-per-node "$NPROC" sft examples/tiny/sft.yaml "$@"
# RM pairs from two samples of the SFT policy per prompt (tiny-task.md); see examples/tiny/rm.yaml.
pairs() {  # OUT PROMPTS NUM
  [ -f "runs/tiny/data/$1.jsonl" ] || megatron-rlhf launch --nproc-per-node "$NPROC" tiny-pairs \
    --policy runs/tiny/sft/checkpoints --prompts "runs/tiny/data/$2.jsonl" --tokenizer runs/tiny/data/tokenizer \
    --num-pairs "$3" --out "runs/tiny/data/$1.jsonl"
}
pairs sft_pairs prompts 8000
pairs sft_pairs_eval prompts_eval 1000   # 500 eval prompts: two pairs each, fresh samples
megatron-rlhf launch --nproc-per-node "$NPROC" rm examples/tiny/rm.yaml "$@"
python - <<'PY'
import json
from megatron_rlhf.metrics import read_jsonl
sft = [r for r in read_jsonl("runs/tiny/sft/metrics.jsonl") if "eval/loss" in r][-1]
rm = [r for r in read_jsonl("runs/tiny/rm/metrics.jsonl") if "eval/accuracy" in r][-1]
cal = json.load(open("runs/tiny/rm/reward_calibration.json"))
print(f"SFT held-out loss {sft['eval/loss']:.3f} | RM held-out accuracy {rm['eval/accuracy']:.3f} | "
      f"RM score on SFT samples: mean {cal['mean']:.3f} std {cal['std']:.3f}")
PY
