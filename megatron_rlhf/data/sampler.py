"""Which examples each data-parallel rank takes at each step: deterministic, resumable, DP-size free.

`ShardedBatchSampler` cuts each epoch's seeded permutation into global batches and hands each rank
its contiguous share, or given the examples' token counts an equal number of examples with balanced tokens
(`balanced_share`: packed micro-batches then cost the same on every rank); its cursor (epoch, step in epoch) is checkpointed so a resumed run sees exactly
the batches it would have seen. `eval_batches` covers an evaluation set exactly once.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

from megatron_rlhf.data.dataset import DataError


class ShardedBatchSampler:
    """Per-step index lists for one data-parallel rank; deterministic and resumable.

    Epoch e uses the permutation `default_rng([seed, e])` of range(dataset_size) (identity with
    shuffle=False), cut into `steps_per_epoch = dataset_size // global_batch_size` global batches (the
    remainder is skipped this epoch; the next permutation differs). Rank r of dp_size receives the
    r-th contiguous slice of each global batch, so the union over ranks is the global batch and each
    index appears at most once per epoch. The cursor is global (not per rank): a checkpoint taken at
    one data-parallel size resumes at another with the same global batches.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        key: str = "train.global_batch_size",  # the setting the batch size comes from, for errors
        lengths: Optional[Sequence[int]] = None,  # tokens of each example: shares balanced by tokens
    ):
        if global_batch_size % dp_size != 0:
            raise DataError(f"{key}={global_batch_size} is not divisible by the data-parallel size {dp_size}")
        if dataset_size < global_batch_size:
            raise DataError(
                f"the dataset has {dataset_size} examples, fewer than one global batch "
                f"({key}={global_batch_size}): lower the batch size or add data"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, {dp_size})")
        self.dataset_size, self.global_batch_size = dataset_size, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.epoch, self.step_in_epoch = 0, 0
        self._perm_epoch, self._perm = -1, None
        self.lengths = None if lengths is None else np.asarray(lengths)

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch_size

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def consumed_steps(self) -> int:
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
            else:
                self._perm = np.arange(self.dataset_size)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, epoch: int, step: int) -> List[int]:
        """All indices of global batch `step` of `epoch` (every rank's share, in rank order)."""
        perm = self._permutation(epoch)
        start = step * self.global_batch_size
        return perm[start : start + self.global_batch_size].tolist()

    def __iter__(self) -> Iterator[List[int]]:
        return self

    def __next__(self) -> List[int]:
        """This rank's indices for the next step; advances the cursor (endless: epochs roll over)."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        batch = self.global_batch(self.epoch, self.step_in_epoch)
        self.step_in_epoch += 1
        if self.lengths is not None and self.dp_size > 1:
            return [batch[i] for i in balanced_share(self.lengths[batch].tolist(), self.dp_rank, self.dp_size)]
        return batch[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]

    def state_dict(self) -> Dict[str, int]:
        """The cursor: the next step to yield is (epoch, step_in_epoch). Plain ints (checkpoint-safe)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for key in ("seed", "dataset_size", "global_batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DataError(
                    f"cannot resume the data cursor: the checkpoint has {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; resume with the same data and batch size, or start fresh "
                    "(checkpoint.resume=never checkpoint.overwrite=true)"
                )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])


def balanced_share(lengths: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """Positions (ascending) of the rows of a global batch that rank `dp_rank` takes: every rank the same number
    of rows (len(lengths) / dp_size), their tokens balanced: longest first, each row to the rank with the fewest
    tokens that still has room (ties: the lower rank). Deterministic, so every rank computes the same split;
    losses are normalised by the global token count, so the split changes no result beyond rounding."""
    n = len(lengths)
    if n % dp_size:
        raise ValueError(f"{n} rows do not split evenly over {dp_size} data-parallel ranks")
    room, tokens = [n // dp_size] * dp_size, [0] * dp_size
    mine = []
    for i in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        rank = min((r for r in range(dp_size) if room[r]), key=lambda r: (tokens[r], r))
        room[rank] -= 1
        tokens[rank] += int(lengths[i])
        if rank == dp_rank:
            mine.append(i)
    return sorted(mine)


def eval_batches(dataset_size: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[List[int]]:
    """In-order evaluation batches covering every index exactly once. This rank gets its contiguous
    share of each global batch; the last share may be shorter or empty, so sum metrics and counts and
    all-reduce them (never average per rank)."""
    for start in range(0, dataset_size, global_batch_size):
        stop = min(start + global_batch_size, dataset_size)
        n = stop - start
        per = -(-n // dp_size)
        lo = start + min(n, dp_rank * per)
        hi = start + min(n, (dp_rank + 1) * per)
        yield list(range(lo, hi))
