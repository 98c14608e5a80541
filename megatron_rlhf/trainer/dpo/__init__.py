"""DPO on preference pairs against the frozen SFT policy: `fit` (the stage), `eval` (held-out checks)."""
