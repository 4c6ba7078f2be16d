"""How a step's model inputs are built: the runner's input-builder strategy, chosen once.

``HostInputs`` gathers ``input_ids``, positions and the attention metadata in numpy from the
persistent batch and uploads them in one transfer; ``DeviceStepInputs`` (the Triton path) sends
only the step's diffs and layout, and kernels build the inputs on the device when the step runs
(``device/device_inputs.py``). Both have ``stage`` (on the scheduling thread, when the step is
prepared: marks the scheduled tokens computed in the batch) and ``fill`` (on the execution
thread, in step order: a pending token's placeholder from the previous step's samples).
``make_step_inputs`` picks one; the runner never asks which. The split follows vLLM's GPU model
runner, whose input preparation moved to the device in its V1 engine.
"""

from __future__ import annotations

import numpy as np
import torch

import pagedllm.envs as envs
from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionBatch, AttentionMetadata
from pagedllm.distributed.micro_batch import step_metadata
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.prepared_step import PreparedStep
from pagedllm.worker.upload import to_device


class HostInputs:
    """Inputs gathered on the host and uploaded in one transfer (every backend but Triton's device path).

    Args:
        input_batch: the runner's persistent batch; attention_backend: builds the step's metadata;
        device: where the inputs go; block_size: tokens per KV block; metadata: the model's own
        metadata strategy ``(backend, AttentionBatch) -> metadata`` (Whisper's three layouts:
        ``models/whisper.py``), else ``distributed.micro_batch.step_metadata``.
    """

    name = "host"

    def __init__(self, input_batch: InputBatch, attention_backend: AttentionBackend, device: torch.device,
                 block_size: int, metadata=None) -> None:
        self.input_batch, self.attention_backend = input_batch, attention_backend
        self.device, self.block_size = device, block_size
        self.metadata = metadata or step_metadata  # (backend, AttentionBatch) -> the model's metadata

    def gather(self, slots: np.ndarray, n: np.ndarray, start: np.ndarray, end: np.ndarray,
               qsl: np.ndarray, bidirectional: list | None = None) -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
        """The model inputs of the scheduled requests, and the attention backend's metadata.

        Args:
            slots: ``[R]`` int64 batch slots; ``n``: ``[R]`` tokens scheduled for each;
            start, end: ``[R]`` tokens each has computed before / after this step;
            qsl: ``[R + 1]`` cumulative ``n``; bidirectional: ``AttentionBatch.bidirectional``.
        Returns:
            ``input_ids`` ``[T]`` int64 (a pending token's entry is filled when the step runs),
            ``positions`` ``[T]`` int64 (host arrays: ``stage`` copies them to the device with the
            step's other arrays in one transfer), and the metadata. Marks the tokens computed in the batch.
        """
        b, bs = self.input_batch, self.block_size
        row_slot = np.repeat(slots, n)
        pos = np.arange(qsl[-1], dtype=np.int64) - np.repeat(qsl[:-1] - start, n)
        input_ids = b.token_ids[row_slot, pos].astype(np.int64)
        slot_mapping = b.block_table[row_slot, pos // bs] * bs + pos % bs
        b.num_computed_tokens[slots] = end
        # whole, or as pipeline micro-batches (``distributed/micro_batch.py``)
        meta = self.metadata(self.attention_backend, AttentionBatch(
            query_start_loc=qsl, num_computed=start, seq_lens=end, slot_mapping=slot_mapping,
            block_table=b.block_table, rows=slots, block_size=bs, bidirectional=bidirectional))
        return input_ids, pos, meta

    def stage(self, slots: np.ndarray, n: np.ndarray, start: np.ndarray, end: np.ndarray, qsl: np.ndarray,
              spec: np.ndarray, pend: np.ndarray, pending_src: np.ndarray, rows: np.ndarray,
              bidirectional: list | None = None) -> dict:
        """The step's inputs as ``PreparedStep`` fields, on the device (``spec``: unused here, the
        drafts are already in the batch's token ids; ``pend`` / ``pending_src``: the requests whose
        last input is still being sampled and its row among the previous step's samples; ``rows``:
        the logits rows; ``bidirectional``: the images' spans, ``AttentionBatch.bidirectional``)."""
        input_ids, positions, meta = self.gather(slots, n, start, end, qsl, bidirectional)
        input_ids, positions, logits_rows, pending_idx, pending_src = to_device(
            [input_ids, positions, rows, qsl[1:][pend] - 1, pending_src], self.device)
        return dict(input_ids=input_ids, positions=positions, meta=meta, logits_rows=logits_rows,
                    pending_idx=pending_idx, pending_src=pending_src)

    def fill(self, step: PreparedStep, prev: PreparedStep | None) -> None:
        """Put the previous step's samples where this step's inputs wait for them."""
        if step.pending_idx.numel():
            step.input_ids[step.pending_idx] = prev.sampled[step.pending_src]


class DeviceStepInputs:
    """Inputs built by kernels on the device when the step runs (the Triton path).

    Args: as ``HostInputs``; the backend must be the Triton one.
    """

    name = "device"

    def __init__(self, input_batch: InputBatch, attention_backend: AttentionBackend, device: torch.device) -> None:
        from pagedllm.worker.device.device_inputs import DeviceInputs
        self.input_batch = input_batch
        self.device_inputs = DeviceInputs(input_batch, attention_backend, device)
        self._no_pending = torch.zeros(0, dtype=torch.int64, device=device)

    def stage(self, slots: np.ndarray, n: np.ndarray, start: np.ndarray, end: np.ndarray, qsl: np.ndarray,
              spec: np.ndarray, pend: np.ndarray, pending_src: np.ndarray, rows: np.ndarray,
              bidirectional: list | None = None) -> dict:
        """Only the diffs and the layout now (``DeviceInputs.prepare``); see ``HostInputs.stage``
        (``bidirectional`` must be ``None``: ``make_step_inputs`` gives such models the host builder)."""
        if bidirectional is not None:
            raise ValueError("the device-built inputs carry no bidirectional image spans")
        plan, (logits_rows,) = self.device_inputs.prepare(slots, n, start, end, spec, pend, pending_src, [rows])
        self.input_batch.num_computed_tokens[slots] = end
        return dict(input_ids=None, positions=None, meta=None, logits_rows=logits_rows, device_plan=plan,
                    pending_idx=self._no_pending, pending_src=self._no_pending)

    def fill(self, step: PreparedStep, prev: PreparedStep | None) -> None:
        """Build the whole inputs on the device, the previous step's samples included."""
        prev_sampled = prev.sampled if prev is not None else None
        step.input_ids, step.positions, step.meta = self.device_inputs.materialize(step.device_plan, prev_sampled)


def make_step_inputs(input_batch: InputBatch, attention_backend: AttentionBackend, device: torch.device,
                     block_size: int, bidirectional: bool = False, metadata=None) -> HostInputs | DeviceStepInputs:
    """The device builder for the Triton backend (unless ``PAGEDLLM_DEVICE_INPUTS=0``), else the host
    one; always the host one for a model with ``bidirectional`` image spans (Gemma 3) or its own
    ``metadata`` strategy (``HostInputs``)."""
    if attention_backend.name == "triton" and envs.PAGEDLLM_DEVICE_INPUTS and not bidirectional and metadata is None:
        return DeviceStepInputs(input_batch, attention_backend, device)
    return HostInputs(input_batch, attention_backend, device, block_size, metadata)
