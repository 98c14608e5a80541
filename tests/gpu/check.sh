#!/usr/bin/env bash
# The GPU checks in one go, for a machine with CUDA: tests/gpu, then benchmarks/ppo_iteration.py at the
# SmolLM2-135M shape (fp32 and bf16, TRL's PPOTrainer beside ours when trl is importable) and at the
# reference shape. Each part has its own time limit and runs whatever the one before did; logs and the
# benchmarks' JSON lines go to LOG_DIR.
#
#   bash tests/gpu/check.sh [LOG_DIR] [WHEEL_DIR]
#   ONLY="gpu-tests bench-smollm2" bash tests/gpu/check.sh ...   # some of the parts: gpu-tests, bench-smollm2,
#                                                                 # bench-reference
#
# WHEEL_DIR, for a machine without a package registry: wheels of what its Python lacks (megatron-core,
# omegaconf, datasets with dill and multiprocess, trl), installed without dependencies into
# /tmp/gpu-check-site, which goes first on PYTHONPATH. Leave out what the machine has (a newer pyarrow than
# its own broke `datasets`). On one H200: tests ~150 s, the SmolLM2 part ~280-300 s, the reference part ~50 s.
set -u
cd "$(dirname "$0")/../.."
out=$(realpath "${1:-.}"); wheels=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
    "$wheels"/*.whl || { echo "could not install the wheels in $wheels"; exit 1; }
  export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers, megatron.core as m; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__, 'megatron-core', m.__version__, 'cuda', torch.cuda.is_available())"

part() {  # part NAME SECONDS COMMAND...: run one part under a time limit, its output into NAME.log
  local name=$1 limit=$2; shift 2
  [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || return 0
  local start=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - start))s"
}
part gpu-tests 240 python3 -m pytest tests/gpu -v -rs -p no:cacheprovider
part bench-smollm2 330 python3 benchmarks/ppo_iteration.py --shape smollm2-135m --dtype both --repeats 3
part bench-reference 90 python3 benchmarks/ppo_iteration.py --repeats 3
grep -h '^{' "$out"/bench-*.log > "$out/bench.jsonl" 2>/dev/null
exit 0
