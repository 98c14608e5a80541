"""The `megatron-rlhf report` command line.

::

    megatron-rlhf report runs/tiny/ppo                          # -> runs/tiny/ppo/report.html
    megatron-rlhf report runs/tiny/sft runs/tiny/rm runs/tiny/ppo --out runs/tiny/report.html
    megatron-rlhf report runs/a/ppo runs/b/ppo                  # -> runs/report.html: both runs in every plot

Prints `report: <file>`. A directory that is no run is one line, `error: ...` (exit 2, through cli.py's
user errors: `runs.ReportError`).
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Sequence

from megatron_rlhf.report.runs import load_runs


def default_out(run_dirs: Sequence[str]) -> str:
    """<RUN_DIR>/report.html for one run; for several, report.html in the directory that holds them all."""
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "report.html")
    return os.path.join(os.path.commonpath([os.path.abspath(d) for d in run_dirs]), "report.html")


def write_report(run_dirs: Sequence[str], out: Optional[str] = None, title: Optional[str] = None) -> str:
    """Write the report of `run_dirs` to `out` (default `default_out`); returns its path."""
    from megatron_rlhf.report.page import render

    runs = load_runs(run_dirs)
    page, _ = render(runs, title)
    out = out or default_out(run_dirs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, out)  # a reader (a browser reloading it) never sees half a page
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rlhf report",
        description="One self-contained HTML page (plots, the doctor's findings, held-out samples, configs, "
        "checkpoints) of one or more run directories (a stage's logging.run_dir). Several runs: one section per "
        "stage, the runs of a stage overlaid in every plot.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a stage's logging.run_dir")
    parser.add_argument("--out", help="the HTML file (default: RUN_DIR/report.html for one run, report.html in "
                        "the directory holding all the runs for several)")
    parser.add_argument("--title", help="the page's title (default: the runs' names)")
    args = parser.parse_args(argv)
    print(f"report: {write_report(args.run_dirs, args.out, args.title)}")
    return 0
