"""Draft verification by rejection sampling (``worker/spec_verify.py``) against exact distributions."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import SamplingMetadata
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.spec_verify import expand_metadata, verify


def _md(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata(params=params, output_lens=np.zeros(len(params), np.int64),
                            all_greedy=all(p.greedy for p in params), any_min_tokens=False, any_logit_bias=False)


def _goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum() - 1)


def test_emitted_tokens_have_the_targets_distribution():
    """The first emitted token is distributed as p_0 whatever the draft; after an accepted draft the
    next is distributed as p_1 (chi-square goodness of fit, p > 0.0005, 6000 draws each)."""
    torch.manual_seed(0)
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                         [0.0, 1.5, 1.5, -0.5, 0.2, 0.1],
                         [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    p = rows.softmax(-1).numpy()
    n = 6000
    sampler = Sampler(seed=1)
    for draft in ([1, 2], [0, 1], [5, 5]):   # a middling, the likeliest and a near-impossible first draft
        params = [SamplingParams(temperature=1.0)] * n
        emitted, _ = verify(sampler, rows.repeat(n, 1), _md(params), [draft] * n)
        first = np.bincount([e[0] for e in emitted], minlength=6)
        stat, df = _goodness_of_fit(first, p[0])
        assert stat < {5: 20.5}[df], (draft, stat)
        after = [e[1] for e in emitted if e[0] == draft[0] and len(e) > 1]
        if p[0][draft[0]] > 0.1:  # enough accepted first drafts to judge the row after them
            stat, df = _goodness_of_fit(np.bincount(after, minlength=6), p[1])
            assert len(after) > 500 and stat < {5: 20.5}[df], (draft, stat, len(after))
        assert all(1 <= len(e) <= 3 for e in emitted)


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    rows = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 3.0], [3.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    g = SamplingParams(temperature=0)
    emitted, lps = verify(Sampler(), rows, _md([g]), [[1, 2, 0]])
    assert emitted == [[1, 2, 0, 1]] and lps == [None]             # all kept, then the bonus token
    emitted, _ = verify(Sampler(), rows, _md([g]), [[1, 0, 0]])
    assert emitted == [[1, 2]]                                      # the second draft is refused
    lp = SamplingParams(temperature=0, logprobs=1)
    _, lps = verify(Sampler(), rows, _md([lp]), [[1, 2, 0]])
    assert [e.token_ids[0] for e in lps[0]] == [1, 2, 0, 1] and all(e.rank == 1 for e in lps[0])


def test_expanded_rows_see_the_drafts_as_history():
    """min_tokens counts drafts before each row, and penalties see them in the history."""
    md = SamplingMetadata(params=[SamplingParams(temperature=0, presence_penalty=1.0, min_tokens=2)],
                          output_lens=np.array([1]), all_greedy=True, any_min_tokens=True, any_logit_bias=False,
                          penalty_rows=[0], penalty_outputs=[np.array([4])], penalty_prompts=[np.zeros(0, np.int64)])
    emd, starts = expand_metadata(md, [[5, 6]])
    assert starts.tolist() == [0, 3] and emd.output_lens.tolist() == [1, 2, 3]
    assert [o.tolist() for o in emd.penalty_outputs] == [[4], [4, 5], [4, 5, 6]]


def test_sampled_drafts_with_their_distribution_give_the_targets():
    """Drafts drawn from a draft distribution q (sampled drafts): keeping with min(1, p / q) and
    drawing rejections from max(p - q, 0) emits p_0 exactly (chi-square goodness of fit, 6000
    draws) and keeps sum(min(p, q)) of the drafts: more than the point-mass rule, which is exact
    too (a draft drawn independently of the target's draws) but keeps only sum(q * p)."""
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                         [0.0, 1.5, 1.5, -0.5, 0.2, 0.1]])
    p = rows.softmax(-1)
    q = torch.tensor([[0.5, 1.0, 2.0, 0.0, 0.0, -1.0]]).softmax(-1)
    n = 6000
    rng = np.random.default_rng(3)
    qn = q[0].double().numpy()
    drafts = [[int(d)] for d in rng.choice(6, size=n, p=qn / qn.sum())]
    params = [SamplingParams(temperature=1.0)] * n
    for probs, want in (([q] * n, float(torch.minimum(p[0], q[0]).sum())), (None, float((p[0] * q[0]).sum()))):
        emitted, _ = verify(Sampler(seed=2), rows.repeat(n, 1), _md(params), drafts, None, probs)
        stat, df = _goodness_of_fit(np.bincount([e[0] for e in emitted], minlength=6), p[0].numpy())
        assert stat < {5: 20.5}[df], (probs is None, stat)
        kept = sum(e[0] == d[0] for e, d in zip(emitted, drafts)) / n
        assert abs(kept - want) < 0.03, (probs is None, kept, want)
