"""PPO from algo/ lands on the exact KL-regularised optimum pi* = pi_ref exp(r/beta) / Z of a bandit.

Runs examples/exact_optimum.py (the same code a user runs) in-process.
"""

import runpy
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "exact_optimum.py"


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(EXAMPLE), run_name="exact_optimum")


@pytest.mark.parametrize("beta,seed", [(0.2, 0), (0.1, 1)])
def test_ppo_lands_on_the_regularised_optimum(example, beta, seed):
    cfg = example["Config"](beta=beta, seed=seed)
    result = example["run"](cfg, verbose=False)
    assert result.kl_start > 0.3, "the problem must start far from the optimum to prove anything"
    assert result.kl_final < 0.01, result
    assert result.kl_final < 0.05 * result.kl_start, result
    assert 0 <= result.objective_gap < 1e-3, result
    assert result.converged(cfg)


def test_example_exits_nonzero_when_not_converged(example, capsys):
    assert example["main"](["--iterations", "2", "--quiet"]) == 1
    assert "FAILED" in capsys.readouterr().err
