"""`megatron-rlhf report RUN_DIR [RUN_DIR ...] [--out FILE]`: one self-contained HTML page of runs.

`runs` reads run directories (metrics, config, summaries, samples, doctor findings, checkpoints), `plots` draws
each stage's figures (matplotlib, Agg, inline PNG), `page` renders the page (Jinja2), `command` is the command line.
matplotlib and Jinja2 are imported only when a report is made.
"""
