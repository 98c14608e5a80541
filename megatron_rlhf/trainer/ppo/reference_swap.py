"""`ppo.reference_mode=swap`: the frozen reference lives in host memory and borrows the policy's model.

The reference is by definition the policy's initial weights (both come from `model.load`), so instead of
a second model on the device, `HostReference` keeps one host copy of the policy's parameters taken right
after the policy is loaded (before any optimizer step or resume). For the reference forward, `swapped()`
exchanges every policy parameter with its host copy, one parameter at a time; leaving the block exchanges
them again, so the policy gets its own weights back bit for bit (plain copies, no arithmetic).

    device memory:  one parameter's worth of scratch during a swap, instead of a whole second model
    host memory:    one copy of this rank's policy shard (pinned on GPU)

`experience.forward_collect` runs the policy's chunks (training layout, pipeline schedule) inside
`swapped()` when it is handed a `HostReference` (`swaps_into` attribute).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence

import torch


def _named_params(chunks: Sequence[torch.nn.Module]):
    from megatron.core.utils import unwrap_model

    for i, chunk in enumerate(chunks):
        for name, p in unwrap_model(chunk).named_parameters():
            yield f"{i}.{name}", p


class HostReference:
    """The reference model as host copies of the policy's parameters (module docstring)."""

    def __init__(self, policy_chunks: Sequence[torch.nn.Module]):
        self.swaps_into: List[torch.nn.Module] = list(policy_chunks)
        pin = torch.cuda.is_available()
        self.names: List[str] = []
        self.host: List[torch.Tensor] = []
        for name, p in _named_params(self.swaps_into):
            self.names.append(name)
            self.host.append(torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin).copy_(p.detach()))
        self.inside = False

    def __iter__(self):
        # Nothing for models.resident / offload_now to move: the weights are in host memory already,
        # and the policy's chunks must never be moved by them.
        return iter(())

    @torch.no_grad()
    def _exchange(self) -> None:
        """policy parameter <-> host copy, for every parameter (device scratch: one parameter)."""
        params = dict(_named_params(self.swaps_into))
        if list(params) != self.names:
            raise RuntimeError("ppo.reference_mode=swap: the policy's parameters changed since the reference "
                               "copy was taken (names or order differ); use ppo.reference_mode=separate")
        for name, host in zip(self.names, self.host):
            p = params[name]
            if p.shape != host.shape or p.dtype != host.dtype:
                raise RuntimeError(f"ppo.reference_mode=swap: parameter {name} is {tuple(p.shape)} {p.dtype}, "
                                   f"its reference copy {tuple(host.shape)} {host.dtype}")
            # copy=True: on CPU `to` would return `host` itself, and the next line would overwrite it
            scratch = host.to(p.device, non_blocking=True, copy=True)  # the other weights, on the device
            host.copy_(p.detach())  # this one's weights, to the host
            p.detach().copy_(scratch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies must be complete before they are read again

    @contextlib.contextmanager
    def swapped(self) -> Iterator[List[torch.nn.Module]]:
        """The policy's chunks holding the reference weights inside the block (the policy's own after)."""
        if self.inside:
            raise RuntimeError("HostReference.swapped() is not re-entrant")
        self.inside = True
        self._exchange()
        try:
            yield self.swaps_into
        finally:
            self._exchange()
            self.inside = False
