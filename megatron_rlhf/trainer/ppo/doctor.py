"""The PPO doctor: live one-line warnings for the failure modes of ppo-spec.md ("Failure modes").

::

    doctor = Doctor(DoctorConfig())             # or Doctor(DoctorConfig(clip_fraction_max=0.25))
    for it in range(start, iterations):
        stats = {...}                           # the iteration's ppo/* floats, eval/* every N iterations
        for w in doctor.check(it, stats):
            print(w.message)
        metrics.log(it, {**stats, **doctor.counts()})
    checkpoint["doctor"] = doctor.state_dict()  # plain JSON-able types; load_state_dict on resume

Watched keys (any may be absent; non-numeric values are ignored, so a missing key never raises):
ppo/kl_per_seq, ppo/clip_fraction, ppo/approx_kl, ppo/value_explained_variance, ppo/entropy,
ppo/truncation_rate, ppo/response_length (quoted in truncation messages), ppo/rho_mean,
ppo/group_flat_fraction (critic-free estimators),
eval/gold_score with eval/rm_score (an eval counts only when both are logged together).

Warning policy: `counts()` counts every iteration a condition holds; a warning's message is emitted
at most once every `repeat_every` iterations per name, so a condition that holds (or flickers)
for 30 iterations emits 3 messages, not 30. Windows count observations of a metric (iterations that
logged it), not iteration numbers. Pure stdlib: no torch, no megatron.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

from megatron_rlhf.config.ppo import DoctorConfig

NAMES = (
    "kl_blowup", "clip_fraction", "approx_kl", "negative_kl", "value_lag",
    "entropy_collapse", "truncation_rising", "rho_off", "reward_hacking", "no_signal",
)  # fmt: skip
KL, CLIP, APPROX_KL, EV = "ppo/kl_per_seq", "ppo/clip_fraction", "ppo/approx_kl", "ppo/value_explained_variance"
ENTROPY, TRUNC, LENGTH, RHO = "ppo/entropy", "ppo/truncation_rate", "ppo/response_length", "ppo/rho_mean"
GOLD, RM = "eval/gold_score", "eval/rm_score"
FLAT = "ppo/group_flat_fraction"  # grpo/rloo/remax: groups whose scores are all equal (zero advantage)
_SERIES = (KL, CLIP, APPROX_KL, EV, ENTROPY, TRUNC, LENGTH, RHO, FLAT)
ADVICE = {  # what to do, appended to the numbers of each warning
    "kl_blowup": "lower the lr, raise ppo.beta (or set ppo.adaptive_kl_target), or use fewer ppo.epochs",
    "clip_fraction": "policy updates are too large; lower the lr or use fewer ppo.epochs",
    "approx_kl": "each update moves the policy too far; lower the lr or use fewer ppo.epochs",
    "negative_kl": "the samples do not come from the policy; sample at temperature 1.0 without top-p/top-k "
    "and check that sampler, trainer and reference logprobs agree",
    "value_lag": "the value model does not track returns; raise its lr or ppo.vf_coef, warm it up before the "
    "policy, or check it is initialised from the RM",
    "entropy_collapse": "the policy is collapsing onto few answers; raise ppo.beta or lower the lr",
    "truncation_rising": "responses hit ppo.max_new_tokens without EOS; raise ppo.missing_eos_penalty or "
    "ppo.beta, or check the RM for a length bias",
    "rho_off": "the sampler and the trainer disagree on logprobs (temperature, top-p/top-k, tokenizer path, "
    "numerics); fix that before trusting the run",
    "reward_hacking": "the policy exploits the reward model; raise ppo.beta, lower the lr, or improve the RM",
    "no_signal": "most groups score all alike, so their advantages are zero; raise ppo.samples_per_prompt or "
    "ppo.temperature, use harder prompts, or a reward that separates responses",
}


class DoctorWarning(NamedTuple):
    """`name` is one of NAMES; `message` is one line: the numbers, then what to do."""

    name: str
    message: str


def _number(value: Any) -> Optional[float]:
    """float(value) for numbers (and 1-element tensors); None for absent or non-numeric values."""
    if value is None or isinstance(value, (str, bytes, bool)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs)


class Doctor:
    """Keeps the short history each check needs; see the module docstring."""

    def __init__(self, config: Optional[DoctorConfig] = None):
        self.config = c = config or DoctorConfig()
        self._keep = max(c.kl_window + 1, c.negative_kl_window, c.ev_window, c.entropy_window, 2 * c.truncation_window,
                         c.no_signal_window)
        self._early: Dict[str, List[float]] = {k: [] for k in _SERIES}  # first `early` observations
        self._recent: Dict[str, List[float]] = {k: [] for k in _SERIES}  # last `_keep` observations
        self._seen: Dict[str, int] = {k: 0 for k in _SERIES}
        self._evals: List[List[float]] = []  # [gold, rm] of the last eval_window evals
        self._counts: Dict[str, int] = {n: 0 for n in NAMES}
        self._last_emit: Dict[str, int] = {}

    def check(self, iteration: int, metrics: Mapping[str, Any]) -> List[DoctorWarning]:
        """Record this iteration's metrics; return the warnings to show now (possibly none).

        `iteration` should increase from call to call; it only paces repeated messages (`repeat_every`).
        """
        values = {k: v for k in (*_SERIES, GOLD, RM) if (v := _number(metrics.get(k))) is not None}
        for key in _SERIES:
            if key in values and math.isfinite(values[key]):
                self._record(key, values[key])
        has_eval = all(k in values and math.isfinite(values[k]) for k in (GOLD, RM))
        if has_eval:  # one eval = gold and RM scores logged together
            self._evals = (self._evals + [[values[GOLD], values[RM]]])[-self.config.eval_window :]
        found = self._diagnose(values, has_eval)
        out = []
        for name in NAMES:
            if name not in found:
                continue
            self._counts[name] += 1
            last = self._last_emit.get(name)
            if last is None or not 0 <= iteration - last < self.config.repeat_every:
                self._last_emit[name] = iteration
                out.append(DoctorWarning(name, f"{name}: {found[name]}: {ADVICE[name]}"))
        return out

    def counts(self) -> Dict[str, int]:
        """{"warn/<name>": iterations on which the condition held so far}, every name included."""
        return {f"warn/{n}": self._counts[n] for n in NAMES}

    def state_dict(self) -> Dict[str, Any]:
        return copy.deepcopy(
            dict(early=self._early, recent=self._recent, seen=self._seen, evals=self._evals,
                 counts=self._counts, last_emit=self._last_emit)
        )  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"early", "recent", "seen", "evals", "counts", "last_emit"} - set(state)
        if missing:
            raise ValueError(f"Doctor.load_state_dict: state lacks {sorted(missing)}; pass Doctor.state_dict() output")
        s = copy.deepcopy(dict(state))
        self._early = {k: s["early"].get(k, [])[: self.config.early] for k in _SERIES}
        self._recent = {k: s["recent"].get(k, [])[-self._keep :] for k in _SERIES}
        self._seen = {k: int(s["seen"].get(k, 0)) for k in _SERIES}
        self._evals = s["evals"][-self.config.eval_window :]
        self._counts = {n: int(s["counts"].get(n, 0)) for n in NAMES}
        self._last_emit = {n: int(i) for n, i in s["last_emit"].items() if n in NAMES}

    # ------------------------------------------------------------------------------------------

    def _record(self, key: str, value: float) -> None:
        self._seen[key] += 1
        if len(self._early[key]) < self.config.early:
            self._early[key].append(value)
        self._recent[key] = (self._recent[key] + [value])[-self._keep :]

    def _initial(self, key: str) -> Optional[float]:
        early = self._early[key]
        return _mean(early) if len(early) == self.config.early else None

    def _diagnose(self, v: Dict[str, float], has_eval: bool) -> Dict[str, str]:
        """name -> the numbers that show its condition, for each condition that holds this iteration."""
        c, found = self.config, {}
        if KL in v and not math.isfinite(v[KL]):
            found["kl_blowup"] = f"{KL} is {v[KL]}, the policy diverged (resume from the last good checkpoint)"
        elif KL in v:
            kl, recent, init = v[KL], self._recent[KL], self._initial(KL)
            before = recent[-(c.kl_window + 1) : -1]
            if before and kl - min(before) > c.kl_jump:
                found["kl_blowup"] = f"{KL} rose {min(before):.3g} -> {kl:.3g} nats within {c.kl_window} iterations"
            elif init is not None and kl > c.kl_multiple * max(init, c.kl_floor):
                found["kl_blowup"] = (
                    f"{KL} is {kl:.3g} nats, over {c.kl_multiple:g}x its initial {init:.3g} (floored at {c.kl_floor:g})"
                )
            window = recent[-c.negative_kl_window :]
            if len(window) == c.negative_kl_window and _mean(window) < -c.negative_kl_tol:
                found["negative_kl"] = (
                    f"{KL} averaged {_mean(window):.3g} nats over the last {len(window)} iterations "
                    f"(< -{c.negative_kl_tol:g})"
                )
        if CLIP in v and v[CLIP] > c.clip_fraction_max:
            found["clip_fraction"] = f"{CLIP} is {v[CLIP]:.3g} > {c.clip_fraction_max:g}"
        if APPROX_KL in v and v[APPROX_KL] > c.approx_kl_max:
            found["approx_kl"] = f"{APPROX_KL} is {v[APPROX_KL]:.3g} > {c.approx_kl_max:g} per update"
        window = self._recent[EV][-c.ev_window :]
        if EV in v and self._seen[EV] >= max(c.ev_warmup, c.ev_window) and _mean(window) <= c.ev_min:
            found["value_lag"] = (
                f"{EV} averaged {_mean(window):.3g} over the last {len(window)} iterations (<= {c.ev_min:g}) "
                f"after {self._seen[EV]} iterations"
            )
        init, window = self._initial(ENTROPY), self._recent[ENTROPY][-c.entropy_window :]
        if ENTROPY in v and init is not None and len(window) == c.entropy_window:
            if max(window) < c.entropy_fraction * init:
                found["entropy_collapse"] = (
                    f"{ENTROPY} fell {init:.3g} -> {window[-1]:.3g} per token, below {c.entropy_fraction:g}x "
                    f"its initial level for {len(window)} iterations"
                )
        init, recent, w = self._initial(TRUNC), self._recent[TRUNC], c.truncation_window
        if TRUNC in v and init is not None and len(recent) >= 2 * w:
            now, before = _mean(recent[-w:]), _mean(recent[-2 * w : -w])
            if now > init + c.truncation_margin and now > before:
                first, last = self._initial(LENGTH), self._recent[LENGTH][-1:]
                length = f", {LENGTH} {first:.3g} -> {last[0]:.3g}" if first is not None and last else ""
                found["truncation_rising"] = (
                    f"{TRUNC} rose {init:.3g} -> {now:.3g} (mean of the last {w}) and is still rising{length}"
                )
        if RHO in v and math.isfinite(v[RHO]) and abs(v[RHO] - 1.0) > c.rho_tol:
            found["rho_off"] = f"{RHO} is {v[RHO]:.4g}, off 1 by more than {c.rho_tol:g}"
        window = self._recent[FLAT][-c.no_signal_window :]
        if FLAT in v and len(window) == c.no_signal_window and _mean(window) > c.no_signal_fraction:
            found["no_signal"] = (
                f"{FLAT} averaged {_mean(window):.3g} over the last {len(window)} iterations "
                f"(> {c.no_signal_fraction:g})"
            )
        if has_eval:
            (g0, r0), (g1, r1) = self._evals[0], self._evals[-1]
            if len(self._evals) == c.eval_window and g1 < g0 - c.eval_tol and r1 > r0 + c.eval_tol:
                found["reward_hacking"] = (
                    f"{GOLD} fell {g0:.3g} -> {g1:.3g} over the last {c.eval_window} evals while {RM} rose "
                    f"{r0:.3g} -> {r1:.3g}"
                )
        return found
