"""Issue 45 item 2: a reward model with its own tokenizer reads each rollout as the preference loader renders the same
prompt and response text for it (what it was trained on); rows longer than its positions keep the prompt's start
and the whole response, and are counted. Scores in PPO against direct scoring: tests/distributed/test_reward_models.py."""

import json

import pytest
import torch

from megatron_rlhf.config.schema import DataConfig
from megatron_rlhf.data import dataset as D
from megatron_rlhf.data import tokenizer as T
from megatron_rlhf.tasks import sort_digits
from megatron_rlhf.trainer.ppo.reward_tokens import RewardTokens, prompt_sources
from tests.unit.test_data import chat_tok, write_lines  # noqa: F401 - chat_tok is a fixture


def _policy_batch(tok, prompts, responses, ended):
    """A policy micro-batch (Experience.microbatches' keys) of prompt ids and response ids (the stop id included where
    `ended`)."""
    T_ = max(len(r) for r in responses)
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    mb = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
          "prompt_lengths": torch.tensor([len(p) for p in prompts]),
          "response_ids": torch.zeros(len(rows), T_, dtype=torch.long),
          "response_mask": torch.zeros(len(rows), T_), "ended": torch.tensor(ended)}
    for i, (row, r) in enumerate(zip(rows, responses)):
        mb["input_ids"][i, : len(row)] = torch.tensor(row)
        mb["response_ids"][i, : len(r)] = torch.tensor(r)
        mb["response_mask"][i, : len(r)] = 1.0
    return mb


def test_text_rows_are_rendered_as_the_preference_loader_renders_them(tmp_path, smollm2):
    """The tiny task's word-level policy tokenizer, SmolLM2's BPE for the reward model."""
    from megatron_rlhf.checkpoint.hf import TOKENIZER_DIR

    policy = sort_digits.build_tokenizer()
    reward = T.load_tokenizer(str(smollm2["megatron"] / TOKENIZER_DIR))
    data = DataConfig(max_seq_len=64)
    texts = ["sort 3 1 2 =", "sort 9 0 =", "sort 5 5 4 1 ="]
    prompts, _ = D.load_examples("prompt", data, policy, write_lines(tmp_path / "q.jsonl",
                                                                      [{"prompt": t} for t in texts]), log=None)
    answers = ["1 2 3", "0 9 9", "1 4 5"]
    ids = [policy(a, add_special_tokens=False)["input_ids"] for a in answers]
    ended = [True, False, True]
    responses = [r + [sort_digits.EOS_ID] if e else r for r, e in zip(ids, ended)]
    mb = _policy_batch(policy, prompts["prompt_ids"], responses, ended)
    rows = RewardTokens(policy, reward, data, prompt_sources(prompts), limit=64)(mb)

    pairs = [{"prompt": t, "chosen": a, "rejected": a + " 7"} for t, a in zip(texts, answers)]
    direct, _ = D.load_examples("preference", data, reward, write_lines(tmp_path / "p.jsonl", pairs), log=None)
    for i, e in enumerate(ended):
        want = direct[i]["chosen_ids"] if e else (reward(texts[i])["input_ids"] +
                                                  reward(answers[i], add_special_tokens=False)["input_ids"])
        n = int(rows["lengths"][i])
        assert rows["input_ids"][i, :n].tolist() == want, i
        assert (want[-1] == reward.eos_token_id) == e, i  # an ended row ends with the reward model's EOS
    assert reward.convert_ids_to_tokens(rows["input_ids"][0, : int(rows["lengths"][0])].tolist())[-1] == "<|im_end|>"

    response = reward(answers[0], add_special_tokens=False)["input_ids"] + [reward.eos_token_id]
    limit = len(response) + 2  # two prompt tokens fit
    cut = RewardTokens(policy, reward, data, prompt_sources(prompts), limit=limit)
    short = cut(mb)
    n = int(short["lengths"][0])
    assert n == limit and short["input_ids"][0, :n].tolist() == direct[0]["chosen_ids"][:2] + response
    seconds, rendered, truncated = cut.take_counts()
    assert rendered == 3 and truncated == 3 and seconds > 0 and cut.take_counts()[1:] == (0, 0)
    tiny = RewardTokens(policy, reward, data, prompt_sources(prompts), limit=3)(mb)  # not even the response fits
    assert tiny["input_ids"][0, :3].tolist() == direct[0]["chosen_ids"][:1] + response[:2]


@pytest.fixture
def other_chat_tok(chat_tok, tmp_path):
    """The same words under other ids, with another template: the reward model's own tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(reversed(chat_tok.convert_ids_to_tokens(list(range(len(chat_tok)))))) + ["[turn]"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                unk_token="<unk>")
    t.chat_template = ("{% for m in messages %}[turn] {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
                       "{% if add_generation_prompt %}[turn] assistant {% endif %}")
    t.save_pretrained(str(tmp_path / "reward_tok"))
    return T.load_tokenizer(str(tmp_path / "reward_tok"))


def test_message_prompts_are_rendered_with_the_reward_models_chat_template(tmp_path, chat_tok, other_chat_tok):
    data = DataConfig(max_seq_len=64)
    turns = [[{"role": "user", "content": "w1 w2"}], [{"role": "system", "content": "w3"},
                                                      {"role": "user", "content": "w4"}]]
    prompts, _ = D.load_examples("prompt", data, chat_tok, write_lines(tmp_path / "q.jsonl",
                                                                        [{"messages": m} for m in turns]), log=None)
    assert [json.loads(s) for s in prompts["prompt_source"]] == turns
    w = chat_tok.convert_tokens_to_ids
    responses = [[w("w5"), w("w6"), w("<end>")], [w("w7")]]  # <end>: the policy's end of turn (its stop set)
    mb = _policy_batch(chat_tok, prompts["prompt_ids"], responses, [True, False])
    rows = RewardTokens(chat_tok, other_chat_tok, data, prompt_sources(prompts), limit=64)(mb)
    shown = [other_chat_tok.convert_ids_to_tokens(rows["input_ids"][i, : int(rows["lengths"][i])].tolist())
             for i in range(2)]
    assert shown[0] == "[turn] user w1 w2 <eos> [turn] assistant w5 w6 <eos>".split()
    assert shown[1] == "[turn] system w3 <eos> [turn] user w4 <eos> [turn] assistant w7".split()  # not ended
    pair = {"chosen": turns[0] + [{"role": "assistant", "content": "w5 w6"}],
            "rejected": turns[0] + [{"role": "assistant", "content": "w7"}]}
    direct, _ = D.load_examples("preference", data, other_chat_tok, write_lines(tmp_path / "p.jsonl", [pair]),
                                log=None)
    assert rows["input_ids"][0, : int(rows["lengths"][0])].tolist() == direct[0]["chosen_ids"]


def _ppo_cfg(tmp_path, reward_vocab=17):
    """A PPO config whose reward model (a model_config.json) has `reward_vocab` ids."""
    from megatron_rlhf.config import model_file
    from megatron_rlhf.config import schema as C
    from megatron_rlhf.models.spec import ModelConfig
    from tests.unit.test_checkpoint_damage import CFG

    model_file.write_model_config(ModelConfig(**{**CFG, "vocab_size": reward_vocab}), str(tmp_path / "rm"))
    cfg = C.PPOConfig()
    for k, v in CFG.items():
        setattr(cfg.model, k, v)
    cfg.model.load, cfg.ppo.reward_load = str(tmp_path), str(tmp_path / "rm")
    return cfg


def test_bad_reward_tokenizers_are_one_line_before_any_model_is_built(tmp_path):
    from megatron_rlhf.config.fields import ConfigError
    from megatron_rlhf.config.ppo import validate_ppo
    from megatron_rlhf.config.stage_models import check_other_models
    from megatron_rlhf.trainer.ppo.reward_tokens import load_reward_tokenizer

    cfg = _ppo_cfg(tmp_path)
    cfg.ppo.reward_tokenizer = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"^ppo.reward_tokenizer: '.*missing' not found: give the reward model's HF "
                                          r"tokenizer directory$"):
        validate_ppo(cfg)
    (tmp_path / "empty").mkdir()
    cfg.ppo.reward_tokenizer = str(tmp_path / "empty")
    with pytest.raises(T.DataError, match=r"^ppo.reward_tokenizer: could not load a tokenizer from '.*empty'"):
        load_reward_tokenizer(cfg, {})
    sort_digits.save_tokenizer(str(tmp_path / "tiny"))  # 17 tokens, no chat template
    cfg.ppo.reward_tokenizer = str(tmp_path / "tiny")
    assert len(load_reward_tokenizer(cfg, {(1, 2): json.dumps("sort 1 =")})) == 17
    with pytest.raises(T.DataError, match=r"^ppo.reward_tokenizer: the prompts are chat messages but the tokenizer at "
                                          r"'.*tiny' has no chat template"):
        load_reward_tokenizer(cfg, {(1, 2): json.dumps([{"role": "user", "content": "sort 1 ="}])})
    small = _ppo_cfg(tmp_path / "small", reward_vocab=12)
    small.ppo.reward_tokenizer = str(tmp_path / "tiny")
    small.ppo.advantage_estimator, small.ppo.samples_per_prompt = "grpo", 2  # no critic from that reward model
    check_other_models(small)  # another vocabulary than the policy's is what ppo.reward_tokenizer is for...
    with pytest.raises(T.DataError, match=r"^ppo.reward_tokenizer: the tokenizer at '.*tiny' has 17 tokens but the "
                                          r"reward model in .* has vocab_size=12: give the tokenizer that reward model "
                                          r"was trained with$"):
        load_reward_tokenizer(small, {})  # ...but not one its own tokenizer does not fit


def test_a_critic_cannot_read_the_reward_models_own_tokens(tmp_path):
    """Item 3: a value model gives a value per policy token: the critic that would start from a reward model with
    its own tokenizer is refused in one line; a critic-free estimator needs none."""
    from megatron_rlhf.config.fields import ConfigError
    from megatron_rlhf.config.stage_models import check_other_models

    cfg = _ppo_cfg(tmp_path, reward_vocab=49152)
    cfg.ppo.reward_tokenizer = str(tmp_path)
    with pytest.raises(ConfigError, match=r"^the value model \(ppo.reward_load=.*\) starts the critic from the reward "
                                          r"model, which reads another tokenizer \(ppo.reward_tokenizer=.*\): a value "
                                          r"model gives a value per policy token, so it needs the policy's tokenizer"):
        check_other_models(cfg)
    cfg.ppo.advantage_estimator, cfg.ppo.samples_per_prompt = "rloo", 2
    check_other_models(cfg)
