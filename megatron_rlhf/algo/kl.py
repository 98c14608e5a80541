"""Per-token KL estimators and the controllers of the KL coefficient beta.

Estimators take `log_ratio = logp - logp_ref` (log pi(y_t|s_t) - log pi_ref(y_t|s_t) at the sampled
token) and estimate KL(pi || pi_ref) when y ~ pi:
    k1 = log_ratio                          unbiased, can be negative per token
    k2 = log_ratio^2 / 2                    biased, low variance, non-negative
    k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, non-negative, low variance
"""

from __future__ import annotations

from typing import Callable, Dict

import torch


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio**2


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1 keeps precision when the ratio is close to 1 (the common case).
    return torch.expm1(-log_ratio) + log_ratio


ESTIMATORS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate [B, T] from policy and reference log-probs of the sampled tokens [B, T]."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown kl estimator {estimator!r}: use one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[estimator](logprobs - ref_logprobs)


class FixedKLController:
    """A constant beta. Same interface as `AdaptiveKLController` so the trainer need not care."""

    def __init__(self, beta: float):
        if beta < 0:
            raise ValueError(f"kl beta={beta} must be >= 0")
        self.beta = float(beta)

    def update(self, kl: float) -> float:
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])


class AdaptiveKLController:
    """Ziegler et al. (2019) proportional control of beta towards a target KL per sequence.

    After each batch: e = clip((kl - target) / target, -0.2, 0.2); beta *= 1 + gain * e.
    So beta moves by at most 20% x gain per update, up when KL is above target, down when below.
    """

    MAX_ERROR = 0.2

    def __init__(self, init_beta: float, target: float, gain: float = 0.1):
        if init_beta <= 0:
            raise ValueError(f"adaptive kl init_beta={init_beta} must be > 0 (it scales multiplicatively)")
        if target <= 0:
            raise ValueError(f"adaptive kl target={target} must be > 0 (nats per sequence)")
        if not 0 < gain < 1 / self.MAX_ERROR:
            raise ValueError(f"adaptive kl gain={gain} must be in (0, {1 / self.MAX_ERROR}) to keep beta positive")
        self.beta = float(init_beta)
        self.target = float(target)
        self.gain = float(gain)

    def update(self, kl: float) -> float:
        """Update beta from the batch's mean KL (a Python float: the trainer has reduced it to log it)."""
        error = min(max((float(kl) - self.target) / self.target, -self.MAX_ERROR), self.MAX_ERROR)
        self.beta *= 1.0 + self.gain * error
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta, "target": self.target, "gain": self.gain}

    def load_state_dict(self, state: dict) -> None:
        """Restore beta so a resumed run continues where it stopped; target and gain come from the config."""
        self.beta = float(state["beta"])
