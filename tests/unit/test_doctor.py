"""The PPO doctor: each failure mode fires its warning (and only it); a healthy run stays silent."""

import json
import os
import subprocess
import sys
import math
import random

import pytest

from megatron_rlhf.trainer.ppo.doctor import NAMES, Doctor, DoctorConfig

ITERS, EVAL_EVERY, BAD_FROM = 150, 10, 60


def healthy(i, rng):
    """One iteration of a healthy run: reward and KL (to ~2 nats) rising, everything else calm."""
    t = i / (ITERS - 1)
    m = {
        "ppo/rm_score": 1.5 * t + 0.05 * rng.gauss(0, 1),
        "ppo/kl_per_seq": 2.0 * t + 0.02 * rng.gauss(0, 1),
        "ppo/clip_fraction": rng.uniform(0.05, 0.15),
        "ppo/approx_kl": 0.005 * rng.uniform(0.7, 1.3),
        "ppo/value_explained_variance": 0.1 + 0.5 * t + 0.03 * rng.gauss(0, 1),
        "ppo/entropy": 2.0 * math.exp(-0.3 * t) + 0.02 * rng.gauss(0, 1),
        "ppo/response_length": 40 + 5 * t + rng.gauss(0, 1),
        "ppo/truncation_rate": 0.02 + rng.uniform(-0.01, 0.01),
        "ppo/rho_mean": 1.0 + rng.uniform(-0.01, 0.01),
        "ppo/group_flat_fraction": rng.uniform(0.05, 0.45),  # grpo/rloo: a few groups score all alike
    }
    if i % EVAL_EVERY == 0:
        m["eval/gold_score"] = 0.3 + 0.5 * t + 0.01 * rng.gauss(0, 1)
        m["eval/rm_score"] = 1.5 * t + 0.02 * rng.gauss(0, 1)
    return m


def _hack(i, m):
    # after BAD_FROM the gold score falls 0.05 per eval while the RM score climbs 0.2 per eval
    if "eval/gold_score" in m and i > BAD_FROM:
        evals = (i - BAD_FROM) / EVAL_EVERY
        m["eval/gold_score"] = 0.3 + 0.5 * BAD_FROM / (ITERS - 1) - 0.05 * evals
        m["eval/rm_score"] = 1.5 * BAD_FROM / (ITERS - 1) + 0.2 * evals


# name -> (corrupt(i, metrics) in place, first iteration at which the warning may fire)
BAD = {
    "kl_blowup": (lambda i, m: m.update({"ppo/kl_per_seq": m["ppo/kl_per_seq"] + max(0, i - BAD_FROM)}), BAD_FROM),
    "clip_fraction": (lambda i, m: i >= BAD_FROM and m.update({"ppo/clip_fraction": 0.4}), BAD_FROM),
    "approx_kl": (lambda i, m: i >= BAD_FROM and m.update({"ppo/approx_kl": 0.08}), BAD_FROM),
    "negative_kl": (lambda i, m: i >= BAD_FROM and m.update({"ppo/kl_per_seq": -0.3 + 0.02 * (i % 3)}), BAD_FROM),
    "value_lag": (lambda i, m: m.update({"ppo/value_explained_variance": -0.05 + 0.02 * (i % 3)}), 0),
    "entropy_collapse": (lambda i, m: m.update({"ppo/entropy": 2.0 * math.exp(-3 * i / (ITERS - 1))}), 0),
    "truncation_rising": (
        lambda i, m: m.update(
            {
                "ppo/truncation_rate": 0.02 + 0.01 * max(0, i - BAD_FROM),
                "ppo/response_length": 45 + max(0, i - BAD_FROM),
            }
        ),
        BAD_FROM,
    ),
    "rho_off": (lambda i, m: i >= BAD_FROM and m.update({"ppo/rho_mean": 1.08}), BAD_FROM),
    "reward_hacking": (_hack, BAD_FROM),
    # most groups all alike (e.g. every sample already right, or all cut off): zero advantage, no signal
    "no_signal": (lambda i, m: i >= BAD_FROM and m.update({"ppo/group_flat_fraction": 0.8}), BAD_FROM),
}


def run(doctor, corrupt=None, seed=0, start=0, stop=ITERS):
    """Feed iterations [start, stop) of a (possibly corrupted) run; return [(iteration, name, message)]."""
    rng, out = random.Random(seed), []
    for i in range(stop):
        m = healthy(i, rng)  # generated from 0 so a resumed run sees the same numbers
        if corrupt:
            corrupt(i, m)
        if i >= start:
            out += [(i, w.name, w.message) for w in doctor.check(i, m)]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_healthy_run_fires_nothing(seed):
    doctor = Doctor()
    assert run(doctor, seed=seed) == []
    assert doctor.counts() == {f"warn/{n}": 0 for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_each_failure_fires_only_its_warning(name):
    corrupt, earliest = BAD[name]
    doctor = Doctor()
    fired = run(doctor, corrupt)
    assert {n for _, n, _ in fired} == {name}, fired
    assert fired[0][0] >= earliest
    counts = doctor.counts()
    assert counts[f"warn/{name}"] >= len(fired) and sum(counts.values()) == counts[f"warn/{name}"]
    for _, _, message in fired:
        assert message.startswith(f"{name}: ") and "\n" not in message
        assert any(ch.isdigit() for ch in message)


def test_kl_blowup_also_fires_on_a_slow_climb_past_a_multiple_of_its_early_level():
    # 12 nats by the end: never more than 0.5 nats within 5 iterations, but past 10x the (floored) initial level
    corrupt = lambda i, m: m.update({"ppo/kl_per_seq": 12.0 * i / (ITERS - 1)})  # noqa: E731
    fired = run(Doctor(), corrupt)
    assert {n for _, n, _ in fired} == {"kl_blowup"}
    assert "over 10x its initial" in fired[0][2]
    assert fired[0][0] == math.floor(10.0 / 12.0 * (ITERS - 1)) + 1


def test_messages_give_numbers_and_advice():
    fired = run(Doctor(), BAD["reward_hacking"][0])
    message = fired[0][2]
    assert "eval/gold_score fell" in message and "eval/rm_score rose" in message and "raise ppo.beta" in message
    fired = run(Doctor(), BAD["truncation_rising"][0])
    assert "ppo/response_length" in fired[0][2] and "ppo.missing_eos_penalty" in fired[0][2]


def test_a_persistent_condition_is_counted_every_iteration_but_emitted_every_k():
    doctor = Doctor(DoctorConfig(repeat_every=10))
    fired = run(doctor, BAD["clip_fraction"][0])
    assert doctor.counts()["warn/clip_fraction"] == ITERS - BAD_FROM
    assert [i for i, _, _ in fired] == list(range(BAD_FROM, ITERS, 10))


def test_a_single_dip_is_not_an_entropy_collapse_or_negative_kl():
    def corrupt(i, m):
        if i == 80:
            m.update({"ppo/entropy": 0.1, "ppo/kl_per_seq": -0.3})

    assert run(Doctor(), corrupt) == []


def test_resume_from_state_dict_gives_the_same_warnings():
    def everything(i, m):  # several failures at once, so the history of every check matters
        for name in ("truncation_rising", "reward_hacking", "entropy_collapse", "value_lag", "rho_off"):
            BAD[name][0](i, m)
        if i % 7 == 0:
            m["ppo/clip_fraction"] = 0.5

    whole = Doctor()
    expected = run(whole, everything)
    assert {n for _, n, _ in expected} == {"truncation_rising", "reward_hacking", "entropy_collapse", "value_lag",
                                           "rho_off", "clip_fraction"}  # fmt: skip
    for cut in (3, 67, 71, 122):
        first = Doctor()
        got = run(first, everything, stop=cut)
        second = Doctor()
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += run(second, everything, start=cut)
        assert got == expected, cut
        assert second.counts() == whole.counts()


def test_missing_or_odd_values_never_crash():
    rng = random.Random(1)
    doctor = Doctor()
    odd = [None, "n/a", float("nan"), float("inf"), True, [1.0], object()]
    for i in range(ITERS):
        m = healthy(i, rng)
        m = {k: v for k, v in m.items() if rng.random() < 0.5}
        for k in list(m)[:1]:
            m[k] = rng.choice(odd) if rng.random() < 0.3 else m[k]
        doctor.check(i, m)
    doctor.check(ITERS, {})
    assert Doctor().check(0, {"eval/gold_score": 1.0}) == []


def test_nan_kl_is_a_blowup():
    fired = Doctor().check(5, {"ppo/kl_per_seq": float("nan")})
    assert [w.name for w in fired] == ["kl_blowup"] and "nan" in fired[0].message


def test_bad_config_and_state_give_one_line_errors():
    with pytest.raises(ValueError, match="kl_window"):
        DoctorConfig(kl_window=0)
    with pytest.raises(ValueError, match="clip_fraction_max"):
        DoctorConfig(clip_fraction_max=float("nan"))
    with pytest.raises(ValueError, match="state_dict"):
        Doctor().load_state_dict({"counts": {}})


def test_doctor_needs_neither_torch_nor_megatron():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import sys, megatron_rlhf.trainer.ppo.doctor\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, PYTHONPATH=root),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
