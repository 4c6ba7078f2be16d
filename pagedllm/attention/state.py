"""What a hybrid model's state-carrying mixers (short convolution, SSM) get from the runner each step.

Attention layers read the paged KV cache through ``AttentionMetadata``; mixers
whose state is fixed-size per request (``core/state_pool.py``) read and write
their request's slot of the runner's state tensors through a ``StateBatch``.
The flattened batch is the same: request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StateBatch:
    """One step's per-request state view, on the model's device.

    Attributes:
        state_slots: ``[R]`` int64 state slot of each scheduled request.
        has_initial_state: ``[R]`` bool; False for a request whose first token runs this
            step (its slot's old contents are ignored and the state starts at zero).
        query_start_loc: ``[R + 1]`` int64 cumulative query lengths (rows of the flattened batch).
        caches: layer index -> that layer's state tensors, each ``[num_slots, ...]``
            (the runner's; mixers update their requests' slots in place).
        initial_slots: ``[R]`` int64 slot each request's state is read from (``None``: its own
            ``state_slots``); a request starting from a prefix-cache hit reads the hit's checkpoint.
        checkpoints: ``(request index, offset, slot)`` host ints, sorted by request then offset:
            the state after the first ``offset`` (1 ..= segment length) tokens of that request's
            segment is also written to ``slot`` (a prefix-cache checkpoint, ``core/state_checkpoints.py``,
            or a draft slot: ``worker/state_cache.py``).
        req_ids: the ``R`` request ids in row order (empty when the caller does not need them).
    """

    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    query_start_loc: torch.Tensor
    caches: dict[int, list[torch.Tensor]]
    initial_slots: torch.Tensor | None = None
    checkpoints: list[tuple[int, int, int]] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    _conv_index: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _native: dict[str, object] = field(default_factory=dict)  # the C mixers' inputs, built once per step

    @property
    def num_reqs(self) -> int:
        """``R``, the scheduled requests."""
        return int(self.state_slots.shape[0])

    def initial(self, cache: torch.Tensor) -> torch.Tensor:
        """The requests' states before this step: ``cache[state_slots]`` with the rows of requests
        that start now set to zero; ``[R, ...]``, a copy."""
        out = cache[self.state_slots if self.initial_slots is None else self.initial_slots]
        keep = self.has_initial_state.view(-1, *([1] * (out.dim() - 1)))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def initial_index(self) -> torch.Tensor:
        """``[R]`` int64 slot each request's state is read from, -1 for a request that starts now
        (its state starts at zero): what the C mixers take instead of ``initial``'s copy (built
        once per step: every state layer asks)."""
        if "initial" not in self._native:
            src = self.state_slots if self.initial_slots is None else self.initial_slots
            self._native["initial"] = torch.where(self.has_initial_state, src, torch.full_like(src, -1))
        return self._native["initial"]

    def checkpoint_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``checkpoints`` as the C mixers take them: ``(ck_start [R + 1], ck_off [N], ck_slot [N])``
        int64 CPU tensors, request ``r``'s entries ``ck_start[r] .. ck_start[r + 1] - 1`` (built
        once per step)."""
        if "checkpoints" not in self._native:
            ck_start = torch.zeros(self.num_reqs + 1, dtype=torch.int64)
            if not self.checkpoints:  # every range is empty: the kernels read only ck_start
                self._native["checkpoints"] = (ck_start,) * 3
            else:
                reqs = torch.tensor([r for r, _, _ in self.checkpoints], dtype=torch.int64)
                torch.cumsum(torch.bincount(reqs, minlength=self.num_reqs), 0, out=ck_start[1:])
                self._native["checkpoints"] = (ck_start,
                                               torch.tensor([k for _, k, _ in self.checkpoints], dtype=torch.int64),
                                               torch.tensor([s for _, _, s in self.checkpoints], dtype=torch.int64))
        return self._native["checkpoints"]

    def conv_index(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row indices of a causal convolution with ``width`` carried inputs, over an extended buffer
        where each request's ``width`` state rows precede its tokens (built once per width and step).

        Returns:
            ``(token_rows [T], state_rows [R, width], last_rows [R, width])`` int64: where each token
            sits, where each request's carried state goes, and the ``width`` rows that are its new
            state (its last inputs, state rows included when it has fewer tokens than ``width``).
        """
        if width not in self._conv_index:
            qsl = self.query_start_loc
            r = torch.arange(self.num_reqs, device=qsl.device)
            n = qsl[1:] - qsl[:-1]
            token_rows = torch.arange(int(qsl[-1]), device=qsl.device) + width * (torch.repeat_interleave(r, n) + 1)
            w = torch.arange(width, device=qsl.device)
            state_rows = (qsl[:-1] + width * r).unsqueeze(1) + w
            last_rows = (qsl[1:] + width * (r + 1) - width).unsqueeze(1) + w
            self._conv_index[width] = (token_rows, state_rows, last_rows)
        return self._conv_index[width]

    def checkpoints_of(self, i: int) -> list[tuple[int, int]]:
        """Request ``i``'s checkpoints as ``(offset into its segment, slot)``, by offset."""
        return [(k, slot) for r, k, slot in self.checkpoints if r == i]

    def conv_checkpoint_rows(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the checkpoints' states lie in ``conv_index(width)``'s extended buffer.

        Returns:
            ``(rows [C, width], slots [C])`` int64: checkpoint ``c``'s state is the ``width``
            inputs before its boundary, extended-buffer rows ``rows[c]`` (oldest first).
        """
        _, state_rows, _ = self.conv_index(width)
        dev = state_rows.device
        req = torch.tensor([r for r, _, _ in self.checkpoints], dtype=torch.int64, device=dev)
        off = torch.tensor([k for _, k, _ in self.checkpoints], dtype=torch.int64, device=dev)
        slots = torch.tensor([s for _, _, s in self.checkpoints], dtype=torch.int64, device=dev)
        # the request's extended rows are its width state rows then its tokens, so the width
        # inputs before token offset k start k rows after its first state row
        return state_rows[req] + off.unsqueeze(1), slots
