"""Device-side sampling (``worker/device/device_sampler.py``) through Triton's interpreter.

A seeded row draws the same token whatever its batch and row; greedy rows are
the argmax; the draw follows the torch sampler's target distribution
(temperature, top-k, top-p, min-p) by frequency; the batched penalties and
logit bias equal the torch sampler's, and so does the runner's device processing
(``process_on_device``: bias then penalties from a step's ``SamplingMetadata``, a
pending token in the history included); greedy rows with penalties and bias draw
the torch sampler's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.device import device_sampler as ds
from pagedllm.worker.input_batch import SamplingMetadata
from pagedllm.worker.sampler import Sampler, apply_penalties

V = 50


def _tensors(params, positions, step=0):
    return ds.DeviceSamplingTensors.from_params(params, positions, V, torch.device("cpu"), engine_seed=0, step=step)


def test_seeded_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    mine = torch.randn(V, generator=g) * 2
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = [int(ds.sample(mine.unsqueeze(0), _tensors([p], [pos]))[0]) for pos in range(6)]
    for trial in range(2):
        others = torch.randn(4, V, generator=g) * 2
        row = 1 + trial * 2
        batch = torch.cat([others[:row], mine.unsqueeze(0), others[row:]])
        params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=1.3, min_p=0.1)]
        params.insert(row, p)
        got = [int(ds.sample(batch, _tensors(params, [pos] * 5, step=trial))[row]) for pos in range(6)]
        assert got == alone
    assert len(set(alone)) > 1  # the position moves the stream


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    logits[3, 7] = logits[3].max() + 1  # a clear winner
    params = [SamplingParams(temperature=0.0)] * 5
    got = ds.sample(logits, _tensors(params, [0] * 5))
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
                                    SamplingParams(temperature=1.3, min_p=0.05)])
def test_draw_follows_the_torch_samplers_distribution(params):
    vocab = 16
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)) * 1.5
    want = Sampler().target_probs(logits, [params])[0]
    n = 600  # one row per draw: the same seed at positions 0..n-1
    rows = logits.expand(n, vocab).contiguous()
    p = SamplingParams(**{**{f: getattr(params, f) for f in ("temperature", "top_k", "top_p", "min_p")}, "seed": 5})
    st = ds.DeviceSamplingTensors.from_params([p] * n, list(range(n)), vocab, torch.device("cpu"))
    freq = torch.bincount(ds.sample(rows, st), minlength=vocab).float() / n
    assert float(freq[want == 0].sum()) == 0.0  # masked tokens are never drawn
    # total variation distance: at most ~0.06 expected from 600 draws over 16 tokens; a temperature
    # applied twice or a wrong mask gives 0.15 and more
    assert float((freq - want).abs().sum()) / 2 < 0.1
    shaped = ds.shape_logits(logits, ds.DeviceSamplingTensors.from_params([p], [0], vocab, torch.device("cpu")))
    torch.testing.assert_close(shaped.softmax(-1)[0], want)


def test_batched_penalties_and_bias_equal_the_torch_sampler():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g)
    outputs = [[1, 1, 4], [], [7, 8]]
    prompts = [[2, 3], [5], [7]]
    pres, freq, rep = torch.tensor([0.5, 0.0, 0.2]), torch.tensor([0.3, 0.0, 0.1]), torch.tensor([1.2, 1.0, 0.9])
    want = apply_penalties(logits, outputs, prompts, pres, freq, rep)
    counts = torch.zeros(3, V, dtype=torch.int32)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for i, (o, pr) in enumerate(zip(outputs, prompts)):
        for t in o:
            counts[i, t] += 1
        mask[i, pr] = True
    torch.testing.assert_close(ds.apply_penalties(logits, counts, mask, pres, freq, rep), want)
    biased = ds.apply_logit_bias(logits, torch.tensor([0, 0, 2]), torch.tensor([4, 4, 9]), torch.tensor([1.0, 2.0, -5.0]))
    expect = logits.clone()
    expect[0, 4] += 3.0
    expect[2, 9] -= 5.0
    torch.testing.assert_close(biased, expect)


def test_philox_keys_differ_per_seed():
    keys = {ds.philox_key(s) for s in range(100)}
    assert len(keys) == 100 and all(0 <= k < 1 << 62 for k in keys)
    assert np.all(np.array(sorted(keys)) >= 0)


def _metadata(params, outputs, prompts, pending_rows, pending_src):
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    return SamplingMetadata(
        params=params, output_lens=np.array([len(o) for o in outputs], np.int64),
        all_greedy=all(p.temperature == 0 for p in params), any_min_tokens=False,
        any_logit_bias=any(p.logit_bias for p in params), penalty_rows=pen,
        penalty_outputs=[np.array(outputs[i], np.int64) for i in pen],
        penalty_prompts=[np.array(prompts[i] if params[i].repetition_penalty != 1.0 else [], np.int64) for i in pen],
        pending_rows=np.array(pending_rows, np.int64), pending_src=np.array(pending_src, np.int64))


def test_runner_processing_on_device_equals_the_torch_sampler():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, V, generator=g)
    params = [SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.4, logit_bias={3: 2.0, 9: -1.5}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={7: 4.0}),
              SamplingParams(temperature=0, logit_bias={1: -100.0}),
              SamplingParams(temperature=0, frequency_penalty=-0.5, repetition_penalty=0.8)]
    outputs = [[3, 3, 11], [], [7, 2], [4], [9, 9, 9, 12]]
    prompts = [[1, 2], [5], [7, 8, 20], [6], [30, 31]]
    md = _metadata(params, outputs, prompts, pending_rows=[0, 4], pending_src=[1, 0])
    prev = [12, 3]  # row 0's pending token is 3 (a third 3), row 4's is 12
    want = Sampler(0).process(logits.clone(), md, prev)
    got = ds.process_on_device(logits.clone(), md, list(range(5)), prev)
    torch.testing.assert_close(got, want)
    sub = ds.process_on_device(logits[[0, 2, 4]], md, [0, 2, 4], prev)  # the device rows of a mixed batch
    torch.testing.assert_close(sub, want[[0, 2, 4]])
    on_device = ds.process_on_device(logits.clone(), md, list(range(5)), torch.tensor(prev))  # pending ids gathered there
    torch.testing.assert_close(on_device, want)
    sampler = ds.DeviceSampler(Sampler(0))
    logprobs, tokens = sampler(logits.clone(), md, torch.tensor(prev), lambda: prev)
    assert tokens.tolist() == want.argmax(-1).tolist() and logprobs == [None] * 5
