#!/usr/bin/env bash
# Reward hacking made visible on the tiny task (after examples/tiny/run.sh): a weak reward model,
# trained from scratch instead of from the SFT backbone, exploited by PPO without the KL leash
# (ppo.beta=0) and with a 3x higher lr. The RM score climbs while the hidden gold score
# (eval/gold_score) falls; the doctor prints `reward_hacking` warnings and counts them as
# warn/reward_hacking. tiny-task.md measured the weak-RM recipe with plain PyTorch: true 0.75 -> 0.52.
#   bash examples/tiny/reward_hacking.sh            # extra key=value overrides go to the PPO run
# Compare in TensorBoard: tensorboard --logdir runs/tiny  (eval/gold_score vs eval/rm_score), or on one page with the
# good run overlaid: runs/tiny/reward_hacking.html (written at the end; docs/report.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f runs/tiny/ppo/summary.json ] || { echo "run examples/tiny/run.sh first"; exit 2; }
# The RM of examples/tiny/rm.yaml, but initialised at random (the SFT architecture, inline) instead of from SFT.
megatron-rlhf launch --nproc-per-node "$NPROC" rm examples/tiny/rm.yaml logging.run_dir=runs/tiny/rm_weak \
  model.load=null model.num_layers=4 model.hidden_size=128 model.ffn_hidden_size=384 model.num_attention_heads=4 \
  model.num_query_groups=4 model.vocab_size=17 model.max_position_embeddings=64 \
  calibration.policy_load=runs/tiny/sft/checkpoints
megatron-rlhf launch --nproc-per-node "$NPROC" ppo examples/tiny/ppo.yaml \
  ppo.reward_load=runs/tiny/rm_weak/checkpoints logging.run_dir=runs/tiny/ppo_hacked \
  ppo.beta=0 train.lr=3e-4 ppo.iterations=50 "$@"
python - <<'PY'
import json
from megatron_rlhf.trainer.metrics import read_jsonl
rows = read_jsonl("runs/tiny/ppo_hacked/metrics.jsonl")
for r in rows:
    if "eval/gold_score" in r:
        print(f"iteration {r['step']:4d}: eval/rm_score {r['eval/rm_score']:7.3f}  eval/gold_score {r['eval/gold_score']:6.3f}  "
              f"eval/kl {r['eval/kl']:6.2f}")
last = rows[-1]
print("doctor:", {k: v for k, v in last.items() if k.startswith("warn/") and v})
s = json.load(open("runs/tiny/ppo_hacked/summary.json"))
print(f"RM from scratch, beta=0: true reward {s['true_reward_sft']:.3f} -> {s['true_reward_ppo']:.3f} while RM reward "
      f"{s['rm_reward_sft']:.3f} -> {s['rm_reward_ppo']:.3f}")
PY
megatron-rlhf report runs/tiny/ppo runs/tiny/ppo_hacked --out runs/tiny/reward_hacking.html
