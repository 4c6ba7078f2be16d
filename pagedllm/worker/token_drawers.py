"""How a step's tokens are drawn from its logits: the runner's token-drawer strategy, chosen once.

``TorchDrawer`` runs the torch sampler on the host-visible logits (the CPU backends; its seeded
streams are what the CPU suite pins down) or, with a test script, takes the script's tokens;
``DeviceDrawer`` draws on the device (the Triton path, ``device/device_sampler.py``) and leaves the
ids to reach the host through a pinned copy (``StepHandle.result`` reads them). A step with draft
tokens is verified instead (``spec_verify.verify_step``), whichever drawer the runner holds.
Each ``draw`` records the rows' logprobs in the output and returns the host ids, or ``None`` when
they follow later (the device path). As vLLM's V1 sampler, one object per runner, no per-step test.
"""

from __future__ import annotations

import torch

from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.worker.input_batch import SamplingMetadata
from pagedllm.worker.prepared_step import PreparedStep
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.scripted import ScriptedOutput


def record_logprobs(step: PreparedStep, logprobs, out: ModelRunnerOutput) -> None:
    """Put each sampled request's logprobs (``None``: none asked) in ``out.logprobs``."""
    for rid, lp in zip(step.sample_ids, logprobs):
        if lp is not None:
            out.logprobs[rid] = lp


class TorchDrawer:
    """The torch sampler (``worker/sampler.py``), or a test script's tokens.

    Args:
        sampler: the runner's sampler; script: a ``ScriptedOutput`` whose tokens replace the
        sampled ones (tests), or ``None``; eos: the token a script ends with.
    """

    def __init__(self, sampler: Sampler, script: ScriptedOutput | None, eos: int) -> None:
        self.sampler, self.script, self.eos = sampler, script, eos

    def draw(self, step: PreparedStep, logits: torch.Tensor, md: SamplingMetadata, pending: PreparedStep | None,
             out: ModelRunnerOutput) -> list[int]:
        """Sample one token per row of ``logits`` (``[S, vocab]`` float32); ``pending``: the step whose
        samples this step's pending inputs are. Returns the ``S`` host ids."""
        sampled = self.sampler(logits, md, pending and pending.tokens_list())
        record_logprobs(step, sampled.logprobs, out)
        if self.script is None:
            return sampled.token_ids
        return self.script.tokens(md.output_lens.tolist(), self.eos)


class DeviceDrawer:
    """The draw on the device (``device/device_sampler.DeviceSampler``); the ids stay on the device
    in ``step.sampled`` and reach the host through ``step.host_tokens``."""

    def __init__(self, sampler: Sampler, seed: int) -> None:
        from pagedllm.worker.device.device_sampler import DeviceSampler
        self.device_sampler = DeviceSampler(sampler, seed)

    def draw(self, step: PreparedStep, logits: torch.Tensor, md: SamplingMetadata, pending: PreparedStep | None,
             out: ModelRunnerOutput) -> None:
        """As ``TorchDrawer.draw``, but returns ``None``: the host ids follow in ``step.host_tokens``."""
        from pagedllm.worker.device.host_tokens import HostTokens
        logprobs, step.sampled = self.device_sampler(logits, md, pending and pending.sampled,
                                                     pending and pending.tokens_list)
        step.host_tokens = HostTokens(step.sampled)  # read by StepHandle.result, not here
        record_logprobs(step, logprobs, out)
        return None


def make_drawer(sampler: Sampler, backend_name: str, script: ScriptedOutput | None, eos: int,
                seed: int) -> TorchDrawer | DeviceDrawer:
    """The device drawer on the Triton path (without a script), else the torch one."""
    if backend_name == "triton" and script is None:
        return DeviceDrawer(sampler, seed)
    return TorchDrawer(sampler, script, eos)
