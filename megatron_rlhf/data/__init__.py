"""Data: local files read through `datasets` -> tokenised examples -> each rank's padded batches.

- `dataset`: prompt, SFT and preference rows (chat messages through the tokenizer's template).
- `report`: bad-row accounting: what a load did to its rows, its summary and warning lines.
- `tokenizer`: loading the run's tokenizer, its checks against the model, its fingerprint; `DataError`.
- `sampler`: which examples each data-parallel rank takes at each step (sharded, resumable).
- `collate`: examples -> padded tensors and micro-batches.
"""
