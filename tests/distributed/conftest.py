"""Fixtures shared by the distributed test modules."""


import pytest

from megatron_rlhf.tasks import sort_digits
from tests.distributed.launch import CLI, STARTED_JOBS, torchrun
from tests.distributed.stages import task_dir

# 2 heads of 32: vLLM's CPU attention has no kernel for a head size of 16 (test_ppo_vllm.py shares `base`).
MODEL = {"model.num_layers": 2, "model.hidden_size": 64, "model.ffn_hidden_size": 128, "model.num_attention_heads": 2,
         "model.num_query_groups": 2, "model.vocab_size": 17, "model.max_position_embeddings": 32}


def _args(d: dict):
    return [f"{k}={v}" for k, v in d.items()]


# Session scope: PPO (test_ppo.py) and DPO (test_dpo.py) start from the same SFT policy and pairs.
@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """The tiny pipeline at reduced size: data, an SFT policy (250 steps), pairs of its own samples labelled by
    the true score, and a calibrated RM (192 steps: 4 epochs; with 2 PPO exploited it) trained on them."""
    d, write, rng = task_dir(tmp_path_factory, "ppo_base")
    write("sft.jsonl", sort_digits.demonstrations(2048, rng))
    write("prompts.jsonl", sort_digits.prompts(1024, rng))
    write("prompts_eval.jsonl", sort_digits.prompts(128, rng))
    common = {**MODEL, "tokenizer.path": d / "tokenizer", "data.max_seq_len": 24, "data.overlong": "drop",
              "logging.progress_bar": "false", "train.seed": 0}
    torchrun(CLI, "sft", *_args({**common, "data.train_path": d / "sft.jsonl", "train.lr": 3e-3,
                                 "train.min_lr": 3e-4, "train.warmup_steps": 20, "train.global_batch_size": 64,
                                 "train.micro_batch_size": 32, "train.train_steps": 250,
                                 "logging.run_dir": d / "sft"}), nproc=2, timeout=600)
    # The RM learns from pairs of the SFT policy's own samples (labelled by the true score), as in run.sh.
    torchrun(CLI, "tiny-pairs", "--policy", d / "sft" / "checkpoints", "--prompts", d / "prompts.jsonl",
             "--tokenizer", d / "tokenizer", "--num-pairs", 3072, "--out", d / "pairs.jsonl", "--sharpness", 1e9,
             nproc=2, timeout=600)
    torchrun(CLI, "rm", *_args({**common, "model.load": d / "sft" / "checkpoints", "data.train_path": d / "pairs.jsonl",
                                "train.lr": 1e-3, "train.min_lr": 1e-4, "train.global_batch_size": 64,
                                "train.micro_batch_size": 32, "train.epochs": 4, "logging.run_dir": d / "rm",
                                "calibration.prompts_path": d / "prompts.jsonl", "calibration.num_prompts": 128,
                                "calibration.max_new_tokens": 11}), nproc=2, timeout=600)
    return d


# Session scope: stages 1-2 tests only read these files.
@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """Tokenizer, demonstrations and preference pairs with a known rule (chosen: even digits, rejected: odd)."""
    d, write, rng = task_dir(tmp_path_factory, "tiny_data")
    write("sft.jsonl", sort_digits.demonstrations(256, rng))
    write("sft_eval.jsonl", sort_digits.demonstrations(64, rng))

    # Preference pairs with a known rule: the chosen response uses even digits, the rejected odd ones.
    def pair():
        digits = [rng.randrange(10) for _ in range(rng.randint(3, 6))]
        prompt = sort_digits.make_prompt(digits)
        n = len(digits)
        even = " ".join(str(rng.choice([0, 2, 4, 6, 8])) for _ in range(n))
        odd = " ".join(str(rng.choice([1, 3, 5, 7, 9])) for _ in range(n))
        return {"prompt": prompt, "chosen": even, "rejected": odd}

    write("pairs.jsonl", [pair() for _ in range(512)])
    write("pairs_eval.jsonl", [pair() for _ in range(128)])
    return d


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """A test that fails before its job ends must not leave ranks training on (they would slow every later test)."""
    yield
    while STARTED_JOBS:
        STARTED_JOBS.pop().kill_all()
