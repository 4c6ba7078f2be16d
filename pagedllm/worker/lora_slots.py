"""The runner's LoRA adapters: host-memory LRU, device slots, and each step's rows per slot.

``LoRASlots`` is the runner's one helper for adapters (built only with ``enable_lora``):
``register`` learns a new request's adapter, ``plan`` (scheduling thread) turns the step's
requests into a row -> adapter id vector, and ``activate`` (execution thread, so slots never
change under a step that runs) puts the step's adapters in slots and gives the model its
``LoRAStep``. Adapters are read from disk once and kept, at most ``max_cpu_loras`` of them, least
recently used evicted, never one a live request holds (``release`` ends a hold): a request's adapter
is read once for its whole life, so unloading it from the server, or its directory going away, cannot
change it under the request. A slot is reused by the least recently used adapter absent from the step.
The scheduler never puts more than ``max_loras`` distinct adapters in one step.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.gguf_adapter import load_adapter
from pagedllm.lora.peft_reader import LoRAAdapter, check_shapes
from pagedllm.lora.request import LoRARequest
from pagedllm.models.lora_linear import LoRAStep, install_lora, lora_layer_specs, projection_shapes

PADDED_RATIO = 4  # the padded mode's buffer may hold this many times the step's adapter rows


class LoRASlots:
    """Adapters of a model in ``max_loras`` slots.

    Args:
        model: a native Llama-family model or a ``TransformersCausalLM`` (``models.lora_linear``:
            ``lora_layer_specs`` names its linears, ``install_lora`` wraps them).
        config: the engine's ``LoRAConfig``.
        device: where step row indices go.
    Raises:
        ValueError: a model whose linears ``lora_layer_specs`` cannot name.
    """

    def __init__(self, model, config: LoRAConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        specs = lora_layer_specs(model)
        self.table = install_lora(model, specs, config.max_loras, config.max_lora_rank)
        self.shapes = projection_shapes(specs)
        self.num_layers = len(specs)
        # head counts and model_type for GGUF adapters (the backend's model keeps its config on ``hf``)
        self.text_config = getattr(model, "config", None) or model.hf.config.get_text_config()
        self.requests: dict[int, LoRARequest] = {}       # int id -> its request (first seen)
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, LRU order
        self.slot_ids = [0] * config.max_loras            # adapter id held by each slot (0: none)
        self.slot_used = [0] * config.max_loras           # activation counter of each slot's last use
        self.activations = 0
        self.loads = 0                                     # adapters read from disk (tests, stats)
        self.live: dict[int, int] = {}                     # int id -> requests the runner holds with it

    def register(self, lora: LoRARequest | None) -> int:
        """Remember a request's adapter; returns its int id (0: the base model)."""
        if lora is None:
            return 0
        self.requests.setdefault(lora.lora_int_id, lora)
        self.live[lora.lora_int_id] = self.live.get(lora.lora_int_id, 0) + 1
        return lora.lora_int_id

    def release(self, lid: int) -> None:
        """A request with adapter ``lid`` (0: none) left the runner (finished or preempted)."""
        if lid and self.live.get(lid, 0) > 1:
            self.live[lid] -= 1
        elif lid:
            self.live.pop(lid, None)

    @staticmethod
    def plan(ids_per_request: np.ndarray, num_tokens: np.ndarray) -> np.ndarray | None:
        """``[T]`` int64 adapter id of each flattened row (0: base), or ``None`` when no row has one.

        Args:
            ids_per_request: ``[R]`` int64 adapter ids of the step's requests, in batch order.
            num_tokens: ``[R]`` int64 tokens each computes.
        """
        if not ids_per_request.any():
            return None
        return np.repeat(ids_per_request, num_tokens)

    def activate(self, row_ids: np.ndarray | None) -> LoRAStep | None:
        """Put the step's adapters in slots and group its rows by slot (execution thread).

        Several adapters with few rows each (decode) take the padded mode (``LoRAStep.padded``: a
        fixed number of batched products whatever the adapter count) when its buffer of
        ``max_loras * g`` rows is at most ``PADDED_RATIO`` times the adapter rows (or 64 rows);
        otherwise one matmul pair per adapter on its gathered rows.

        Raises:
            ValueError: more distinct adapters than ``max_loras`` (the scheduler prevents it), or an
                adapter that no longer reads or does not fit the model.
        """
        if row_ids is None:
            return None
        self.activations += 1
        ids = [int(i) for i in np.unique(row_ids) if i]
        if len(ids) > self.config.max_loras:
            raise ValueError(f"{len(ids)} adapters in one step, max_loras={self.config.max_loras}")
        per_slot = []
        for lid in ids:
            slot = self._slot_for(lid, ids)
            self.slot_used[slot] = self.activations
            per_slot.append((slot, np.flatnonzero(row_ids == lid)))
        g = max(rows.size for _, rows in per_slot)
        num_rows = sum(rows.size for _, rows in per_slot)
        if len(per_slot) > 1 and self.config.max_loras * g <= max(PADDED_RATIO * num_rows, 64):
            rows = np.concatenate([r for _, r in per_slot])
            dest = np.concatenate([slot * g + np.arange(r.size) for slot, r in per_slot])
            return LoRAStep([], (torch.from_numpy(rows).to(self.device), torch.from_numpy(dest).to(self.device), g))
        return LoRAStep([(slot, None if rows.size == row_ids.size else torch.from_numpy(rows).to(self.device))
                         for slot, rows in per_slot])

    def _slot_for(self, lid: int, step_ids: list[int]) -> int:
        """The slot holding adapter ``lid``, loading it into a free or least recently used slot
        whose adapter is not in this step."""
        if lid in self.slot_ids:
            return self.slot_ids.index(lid)
        free = [s for s, held in enumerate(self.slot_ids) if held not in step_ids]
        slot = min(free, key=lambda s: (self.slot_ids[s] != 0, self.slot_used[s]))
        adapter = self._adapter(lid)
        done: set[int] = set()
        for wrappers in self.table.values():
            for layer, wrapper in enumerate(wrappers):  # one wrapper per layer, in layer order
                if id(wrapper) in done:  # a fused wrapper appears under each of its projections
                    continue
                done.add(id(wrapper))
                wrapper.set_slot(slot, {p: adapter.weights[(layer, p)] for p, _, _ in wrapper.pieces
                                        if (layer, p) in adapter.weights}, adapter.scaling)
        self.slot_ids[slot] = lid
        return slot

    def _adapter(self, lid: int) -> LoRAAdapter:
        """Adapter ``lid`` from the host LRU, read from its directory or GGUF file on a miss."""
        if lid in self.cpu:
            self.cpu.move_to_end(lid)
            return self.cpu[lid]
        req = self.requests[lid]
        adapter = load_adapter(req.lora_path, self.config.max_lora_rank, self.text_config)
        check_shapes(adapter, self.shapes, self.num_layers)
        self.loads += 1
        self.cpu[lid] = adapter
        while len(self.cpu) > self.config.max_cpu_loras:
            victim = next((k for k in self.cpu if not self.live.get(k)), None)
            if victim is None:  # every adapter held is a live request's: kept over the bound until they end
                break
            del self.cpu[victim]
        return adapter
