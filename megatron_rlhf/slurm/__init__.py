"""Slurm job scripts for every stage: cluster YAML -> sbatch script (plain or nemo-run), see docs/scale-out.md."""
