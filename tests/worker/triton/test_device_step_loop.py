"""The Triton (device) path's step loop, served end to end through Triton's interpreter.

- Host syncs: while a step runs (issued, run, and its result taken), pagedllm code calls
  ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` or converts a tensor to a Python
  bool/int/float only once: the sampled tokens' read from their non-blocking host copy
  (``worker/device/host_tokens.py``), on the scheduling thread when it takes the result, never on
  the execution thread. (On a GPU each such call waits for the device.)
  The step's inputs are built on the device (``worker/device/device_inputs.py``), placeholders
  included, and logit bias and penalties are applied there (``process_on_device``): the
  count covers both.
- A seeded sampled request draws the same tokens alone and in a batch (device draw).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker import model_runner, prepared_step
from pagedllm.worker.device import device_inputs

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # async scheduling on whatever the environment says (the reference pass turns it off): the
    # placeholders gathered on the device are part of what the test checks
    return LLM(str(tiny_model_dir("llama")), attention_backend="triton", num_kv_blocks=48,
               max_num_batched_tokens=24, max_num_seqs=4, async_scheduling=True)


def test_one_host_sync_per_step(llm, monkeypatch):
    in_step = threading.local()
    calls: Counter = Counter()
    threads: set = set()
    steps = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if getattr(in_step, "on", False) or getattr(in_step, "taking", False):
                caller = sys._getframe(1)
                module = caller.f_globals.get("__name__", "")
                if module.startswith("pagedllm"):  # not triton's interpreter or torch internals
                    calls[(name, module, caller.f_lineno)] += 1
                    threads.add("execution" if getattr(in_step, "on", False) else "scheduling")
            return original(self, *args, **kwargs)
        return method

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    run = model_runner.ModelRunner._run
    result = prepared_step.StepHandle.result

    def counted_run(self, *args, **kwargs):
        in_step.on = True
        try:
            return run(self, *args, **kwargs)
        finally:
            in_step.on = False

    def counted_result(self):
        taking = getattr(in_step, "taking", False)
        in_step.taking = True
        try:
            out = result(self)
        finally:
            in_step.taking = taking
        if not taking and self._batch is not None:
            steps.append(bool(out.sampled_token_ids))
        return out

    monkeypatch.setattr(model_runner.ModelRunner, "_run", counted_run)
    monkeypatch.setattr(prepared_step.StepHandle, "result", counted_result)
    plans = []
    materialize = device_inputs.DeviceInputs.materialize

    def recorded(self, plan, prev_sampled):
        plans.append(plan)
        return materialize(self, plan, prev_sampled)

    monkeypatch.setattr(device_inputs.DeviceInputs, "materialize", recorded)
    assert llm.llm_engine.runner.step_inputs.name == "device"  # the device-side preparation is on
    prompts = [list(range(5, 35)), list(range(7, 12)), list(range(40, 49))]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={5: 3.0}),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=4, ignore_eos=True,
                             presence_penalty=0.5, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, min_p=0.05, max_tokens=4, ignore_eos=True, frequency_penalty=0.3)]
    llm.generate(prompts, params, use_tqdm=False)
    assert len(steps) >= 5 and not all(steps)  # a chunked prefill step samples nothing
    # exactly one per sampling step, all at the same place: the read of the sampled ids' copy,
    # by the thread taking the result (the execution thread never waits for the device)
    assert sum(calls.values()) == sum(steps), calls
    assert {(name, module) for name, module, _ in calls} == {("tolist", "pagedllm.worker.device.host_tokens")}, calls
    assert len({where for where in calls}) == 1 and threads == {"scheduling"}, (calls, threads)
    # every step's inputs were built on the device, some with placeholders gathered there (async
    # scheduling), and each step sent only diffs: at most its own tokens of the token table
    assert len(plans) == len(steps) and any(p.has_pending for p in plans)
    assert all(p.counts[3] <= p.counts[1] for p in plans)


def test_seeded_request_same_alone_and_batched(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=5, ignore_eos=True)
    prompt = list(range(100, 111))
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs = llm.generate([list(range(60, 90)), prompt, [3, 4, 5]], [others[0], seeded, others[1]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids != alone  # sampled, not the argmax
