#!/usr/bin/env bash
# Reward hacking made visible on the tiny task (after examples/tiny/run.sh): a weak reward model,
# trained on only 1000 of the SFT-sample pairs, is exploited by PPO. The RM score climbs while the
# hidden gold score (eval/gold_score) falls; the doctor prints `reward_hacking` warnings and counts
# them as warn/reward_hacking. tiny-task.md measured this with plain PyTorch: true 0.75 -> 0.35.
#   bash examples/tiny/reward_hacking.sh            # extra key=value overrides go to the PPO run
# Compare in TensorBoard: tensorboard --logdir runs/tiny  (eval/gold_score vs eval/rm_score)
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f runs/tiny/ppo/summary.json ] || { echo "run examples/tiny/run.sh first"; exit 2; }
head -n 1000 runs/tiny/data/sft_pairs.jsonl > runs/tiny/data/sft_pairs_1000.jsonl
torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.cli rm examples/tiny/rm.yaml \
  data.train_path=runs/tiny/data/sft_pairs_1000.jsonl logging.run_dir=runs/tiny/rm_weak train.epochs=4
torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.cli ppo examples/tiny/ppo.yaml \
  ppo.reward_load=runs/tiny/rm_weak/checkpoints logging.run_dir=runs/tiny/ppo_hacked "$@"
python - <<'PY'
import json
from megatron_rlhf.metrics import read_jsonl
rows = read_jsonl("runs/tiny/ppo_hacked/metrics.jsonl")
for r in rows:
    if "eval/gold_score" in r:
        print(f"iteration {r['step']:4d}: eval/rm_score {r['eval/rm_score']:7.3f}  eval/gold_score {r['eval/gold_score']:6.3f}  "
              f"eval/kl {r['eval/kl']:6.2f}")
last = rows[-1]
print("doctor:", {k: v for k, v in last.items() if k.startswith("warn/") and v})
s = json.load(open("runs/tiny/ppo_hacked/summary.json"))
print(f"weak RM: true reward {s['true_reward_sft']:.3f} -> {s['true_reward_ppo']:.3f} while RM reward "
      f"{s['rm_reward_sft']:.3f} -> {s['rm_reward_ppo']:.3f}")
PY
