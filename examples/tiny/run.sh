#!/usr/bin/env bash
# The tiny CPU pipeline on 2 gloo ranks: data -> SFT -> preference pairs sampled from the SFT
# policy -> reward model (+ reward calibration) -> PPO against it, KL-penalised to the SFT policy.
# Extra arguments are config overrides applied to both stages, e.g. train.train_steps=50.
# Runs resume where they stopped (checkpoints under runs/tiny/); delete runs/tiny to start over.
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f runs/tiny/data/meta.json ] || megatron-rlhf prepare-tiny runs/tiny/data
megatron-rlhf launch --nproc-per-node "$NPROC" sft examples/tiny/sft.yaml "$@"
# RM pairs from two samples of the SFT policy per prompt (tiny-task.md); see examples/tiny/rm.yaml.
pairs() {  # OUT PROMPTS NUM [tiny-pairs options]
  [ -f "runs/tiny/data/$1.jsonl" ] || megatron-rlhf launch --nproc-per-node "$NPROC" tiny-pairs \
    --policy runs/tiny/sft/checkpoints --prompts "runs/tiny/data/$2.jsonl" --tokenizer runs/tiny/data/tokenizer \
    --num-pairs "$3" --out "runs/tiny/data/$1.jsonl" "${@:4}"
}
pairs sft_pairs prompts 16000  # 8000 left a length-biased RM that PPO exploited (README: the RM recipe)
pairs sft_pairs_eval prompts_eval 1000   # 500 eval prompts: two pairs each, fresh samples
megatron-rlhf launch --nproc-per-node "$NPROC" rm examples/tiny/rm.yaml "$@"
megatron-rlhf launch --nproc-per-node "$NPROC" ppo examples/tiny/ppo.yaml "$@"
# DPO (docs/dpo.md), with WITH_DPO=1 (about 5 more minutes on 2 cores): pairs labelled by the TRUE score
# without noise (--sharpness 1e9), then examples/tiny/dpo.yaml.
[ -z "${WITH_DPO:-}" ] || {
  pairs dpo_pairs prompts 8000 --sharpness 1e9
  pairs dpo_pairs_eval prompts_eval 1000 --sharpness 1e9
  megatron-rlhf launch --nproc-per-node "$NPROC" dpo examples/tiny/dpo.yaml "$@"
}
# One page of every stage (docs/report.md): each stage's plots, PPO's doctor findings and held-out samples.
runs=(runs/tiny/sft runs/tiny/rm runs/tiny/ppo)
[ ! -f runs/tiny/dpo/metrics.jsonl ] || runs+=(runs/tiny/dpo)
megatron-rlhf report "${runs[@]}" --out runs/tiny/report.html > /dev/null  # its path is among the closing lines
python - <<'PY'
import json
import os
from megatron_rlhf.trainer.metrics import read_jsonl
sft = [r for r in read_jsonl("runs/tiny/sft/metrics.jsonl") if "eval/loss" in r][-1]
rm = [r for r in read_jsonl("runs/tiny/rm/metrics.jsonl") if "eval/accuracy" in r][-1]
s = json.load(open("runs/tiny/ppo/summary.json"))
print(f"SFT held-out loss {sft['eval/loss']:.3f} | RM held-out accuracy {rm['eval/accuracy']:.3f}")
print("held-out prompts, sampled at T=1 | SFT policy | PPO policy")
print(f"true reward (hidden gold score)   | {s['true_reward_sft']:10.3f} | {s['true_reward_ppo']:10.3f}")
print(f"RM reward (normalised)            | {s['rm_reward_sft']:10.3f} | {s['rm_reward_ppo']:10.3f}")
print(f"KL to the SFT policy per sequence | {0.0:10.3f} | {s['kl_ppo']:10.3f}")
if os.path.exists("runs/tiny/dpo/summary.json"):
    d = json.load(open("runs/tiny/dpo/summary.json"))
    print(f"DPO (docs/dpo.md): true reward {d['true_reward_sft']:.3f} -> {d['true_reward_dpo']:.3f}, "
          f"KL to the SFT policy per sequence {d['kl_dpo']:.3f}")
print("run directory: runs/tiny (summary: runs/tiny/ppo/summary.json, TensorBoard: runs/tiny/*/tensorboard)")
print("report: runs/tiny/report.html")
PY
