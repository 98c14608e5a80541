"""The gold scorer is user code (issue 22): whatever it does wrong is one ConfigError naming ppo.gold_scorer,
what it returned and what it must return (the prompt, for one that fails on some prompts), never a shape
error from algo/masked.py; and no NaN reaches summary.json (item 8)."""

import json
import math

import pytest

from megatron_rlhf.config.fields import ConfigError, load_gold_scorer
from megatron_rlhf.trainer.ppo.eval import score_texts
from megatron_rlhf.trainer.run import write_json

PROMPTS, RESPONSES = ["sort: 3 1", "sort: 2 2", "sort: 9 0"], ["1 3", "2 2", "0 9"]


def _raises_on_9(prompts, responses):
    if any("9" in p for p in prompts):
        raise ValueError("cannot score nines")
    return [1.0] * len(prompts)


@pytest.mark.parametrize("scorer, said", [
    (lambda p, r: [0.5] * (len(p) + 1), "returned 4 scores for 3 pairs"),
    (lambda p, r: [0.5], "returned 1 scores for 3 pairs"),
    (lambda p, r: 0.5, "returned float 0.5 for 3 pairs"),
    (lambda p, r: None, "returned NoneType None for 3 pairs"),
    (lambda p, r: "good", "returned str 'good' for 3 pairs"),
    (lambda p, r: ["a", "b", "c"], "returned str 'a' for prompt 'sort: 3 1'"),
    (lambda p, r: [1.0, float("nan"), 0.0], "returned nan for prompt 'sort: 2 2'"),
    (_raises_on_9, "raised ValueError: cannot score nines on prompt 'sort: 9 0' (response '0 9')"),
])
def test_a_bad_scorer_is_one_line_naming_it(scorer, said):
    with pytest.raises(ConfigError) as e:
        score_texts(scorer, PROMPTS, RESPONSES)
    msg = str(e.value)
    assert msg.startswith("ppo.gold_scorer (") and said in msg, msg
    assert msg.endswith("it must return one finite number per (prompt, response) pair, in order"), msg


def test_good_scores_pass_as_a_tensor():
    import numpy as np

    assert score_texts(lambda p, r: np.array([1, 2, 3]), PROMPTS, RESPONSES).tolist() == [1.0, 2.0, 3.0]


def test_a_scorer_that_does_not_import_or_is_not_a_function(tmp_path, monkeypatch):
    (tmp_path / "broken_scorer.py").write_text("def score(p, r)\n    return p\n")
    (tmp_path / "not_callable_scorer.py").write_text("score = [1, 2]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"ppo.gold_scorer='broken_scorer:score' cannot be imported \(SyntaxError"):
        load_gold_scorer("broken_scorer:score")
    with pytest.raises(ConfigError, match=r"ppo.gold_scorer='not_callable_scorer:score' is a list, not a function"):
        load_gold_scorer("not_callable_scorer:score")


def test_summary_json_stays_json_with_a_nan(tmp_path):
    path = str(tmp_path / "summary.json")
    write_json(path, {"true_reward_ppo": float("nan"), "kl_ppo": 0.5, "nested": [float("inf")]})
    parsed = json.loads(open(path).read(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert parsed == {"true_reward_ppo": None, "kl_ppo": 0.5, "nested": [None]} and not math.isnan(parsed["kl_ppo"])
