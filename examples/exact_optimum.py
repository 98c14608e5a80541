"""Check PPO built from `megatron_rlhf.algo` against a problem whose answer is known exactly.

A single-step (bandit) policy over K responses to one prompt: response k has a known reward r_k, the
reference policy pi_ref is fixed. The KL-regularised objective
    max_pi  E_pi[r] - beta * KL(pi || pi_ref)
has the optimum pi* = pi_ref * exp(r / beta) / Z. Each response is one token (T = 1), so every
piece of the real PPO update runs unchanged: on-policy samples, shaped rewards with the k1 KL
penalty, GAE against a learned value, advantage whitening, several epochs of clipped policy and
value losses on minibatches. PPO must land near pi*: KL(pi || pi*) small, and much smaller than
KL(pi_ref || pi*) where it started.

    python examples/exact_optimum.py [--beta 0.2] [--iterations 150] [--seed 0]

Prints KL(pi || pi*) per iteration and the final numbers; exits 1 if it did not converge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rlhf.algo.advantages import gae  # noqa: E402
from megatron_rlhf.algo.losses import policy_loss, value_loss  # noqa: E402
from megatron_rlhf.algo.masked import whiten  # noqa: E402
from megatron_rlhf.algo.rewards import shaped_rewards  # noqa: E402


@dataclass
class Config:
    responses: int = 32  # K
    beta: float = 0.2
    iterations: int = 150
    samples: int = 1024  # rollouts per iteration
    epochs: int = 4
    minibatches: int = 4
    lr: float = 0.05  # Adam on the policy logits, decayed linearly to 0
    value_lr: float = 0.1
    clip_eps: float = 0.2
    lam: float = 0.95
    seed: int = 0
    # Pass criteria: absolute, and relative to where PPO started (pi = pi_ref).
    max_kl: float = 0.01
    max_kl_fraction: float = 0.05


@dataclass
class Result:
    kl_start: float  # KL(pi_ref || pi*)
    kl_final: float  # KL(pi || pi*)
    objective_gap: float  # J(pi*) - J(pi) >= 0, J = E[r] - beta * KL(pi || pi_ref)
    history: list

    def converged(self, cfg: Config) -> bool:
        return self.kl_final < cfg.max_kl and self.kl_final < cfg.max_kl_fraction * self.kl_start


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(p || q) between two distributions given as log-probabilities [K]."""
    return float((logp.exp() * (logp - logq)).sum())


def objective(logp, log_ref, r, beta) -> float:
    return float((logp.exp() * r).sum()) - beta * kl(logp, log_ref)


def run(cfg: Config, verbose: bool = True) -> Result:
    g = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    K = cfg.responses
    r = torch.rand(K, generator=g, dtype=torch.float64)  # rewards in [0, 1), like a normalised RM
    log_ref = torch.log_softmax(torch.randn(K, generator=g, dtype=torch.float64), 0)
    log_opt = torch.log_softmax(log_ref + r / cfg.beta, 0)  # pi* = pi_ref exp(r / beta) / Z

    theta = log_ref.clone().requires_grad_(True)  # the policy starts at the reference (like SFT)
    v = torch.zeros((), dtype=torch.float64, requires_grad=True)  # the value of the single prompt
    steps = cfg.iterations * cfg.epochs * cfg.minibatches
    pi_opt = torch.optim.Adam([theta], lr=cfg.lr)
    v_opt = torch.optim.Adam([v], lr=cfg.value_lr)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 - s / steps) for o in (pi_opt, v_opt)]

    kl_start = kl(log_ref, log_opt)
    history = []
    N = cfg.samples
    mask = torch.ones(N, 1, dtype=torch.float64)  # one-token responses: T = 1
    for it in range(cfg.iterations):
        # 1. Rollout on-policy, score, reference and value per (single) response token.
        with torch.no_grad():
            log_pi = torch.log_softmax(theta, 0)
            actions = torch.multinomial(log_pi.exp(), N, replacement=True, generator=g)
            old_logp = log_pi[actions].unsqueeze(1)
            ref_logp = log_ref[actions].unsqueeze(1)
            old_values = v.expand(N, 1).clone()
            # 2. Shaped rewards (score + k1 KL penalty), GAE, whitening: exactly the PPO pipeline.
            rewards = shaped_rewards(r[actions], old_logp, ref_logp, mask, cfg.beta)
            advantages, returns = gae(rewards, old_values, mask, gamma=1.0, lam=cfg.lam)
            advantages = whiten(advantages, mask)
        # 3. Epochs of clipped updates on shuffled minibatches; losses are token sums.
        for _ in range(cfg.epochs):
            for mb in torch.randperm(N, generator=g).chunk(cfg.minibatches):
                logp = torch.log_softmax(theta, 0)[actions[mb]].unsqueeze(1)
                loss, stats = policy_loss(logp, old_logp[mb], advantages[mb], mask[mb], cfg.clip_eps)
                pi_opt.zero_grad()
                (loss / stats["tokens"]).backward()
                pi_opt.step()
                vloss, vstats = value_loss(v.expand(len(mb), 1), old_values[mb], returns[mb], mask[mb], cfg.clip_eps)
                v_opt.zero_grad()
                (vloss / vstats["tokens"]).backward()
                v_opt.step()
                for s in schedules:
                    s.step()
        with torch.no_grad():
            kl_now = kl(torch.log_softmax(theta, 0), log_opt)
        history.append(kl_now)
        if verbose:
            print(f"iter {it:4d}  KL(pi || pi*) = {kl_now:.5f}  value = {v.item():.3f}")

    with torch.no_grad():
        log_pi = torch.log_softmax(theta, 0)
        gap = objective(log_opt, log_ref, r, cfg.beta) - objective(log_pi, log_ref, r, cfg.beta)
    return Result(kl_start=kl_start, kl_final=history[-1] if history else kl_start, objective_gap=gap, history=history)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(Config()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--quiet", action="store_true", help="print only the final line")
    args = vars(parser.parse_args(argv))
    quiet = args.pop("quiet")
    cfg = Config(**{k.replace("-", "_"): v for k, v in args.items()})
    result = run(cfg, verbose=not quiet)
    ok = result.converged(cfg)
    print(
        json.dumps(
            {
                "kl_ref_to_opt": round(result.kl_start, 6),
                "kl_final_to_opt": round(result.kl_final, 6),
                "objective_gap": round(result.objective_gap, 6),
                "converged": ok,
            }
        )
    )
    if not ok:
        print(
            f"FAILED: KL(pi || pi*) = {result.kl_final:.4g} needs < {cfg.max_kl} and < "
            f"{cfg.max_kl_fraction} x KL(pi_ref || pi*) = {cfg.max_kl_fraction * result.kl_start:.4g}",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
