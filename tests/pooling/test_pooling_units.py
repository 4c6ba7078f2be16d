"""Pure parts of the pooling path: the pooler's rows and vectors, base64 encoding, score pairing."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from pagedllm.pooling_params import PoolerConfig, PoolingParams, cosine, pair_texts
from pagedllm.sampling_params import SamplingParamError
from pagedllm.server.embeddings import encode_vector
from pagedllm.worker.pooler import hidden_rows, pool


def test_rows_and_vectors():
    p = lambda t, **kw: PoolingParams(pooling_type=t, normalize=False, **kw)  # noqa: E731
    rows, spans = hidden_rows(["a", "b", "c"], [p("CLS"), p("MEAN"), p("LAST")], np.array([0, 3, 7]),
                              np.array([3, 7, 9]), np.array([0, 0, 40]))
    assert rows.tolist() == [0, 3, 4, 5, 6, 8]
    h = torch.arange(12, dtype=torch.float32).view(6, 2)
    out = pool(h, spans)
    assert out["a"] == [0.0, 1.0] and out["b"] == [5.0, 6.0] and out["c"] == [10.0, 11.0]
    with pytest.raises(ValueError, match="whole prompt"):
        hidden_rows(["x"], [p("MEAN")], np.array([0]), np.array([4]), np.array([16]))


def test_dimensions_then_normalize():
    spans = hidden_rows(["a"], [PoolingParams("LAST", True, 2)], np.array([0]), np.array([1]), np.array([0]))[1]
    assert pool(torch.tensor([[3.0, 4.0, 12.0]]), spans)["a"] == pytest.approx([0.6, 0.8])


def test_resolved_defaults_and_errors():
    enc = PoolerConfig("MEAN", True, 384)
    r = PoolingParams().resolved(enc)
    assert (r.pooling_type, r.normalize) == ("MEAN", True)
    assert PoolingParams(pooling_type="cls", normalize=False).resolved(enc).pooling_type == "CLS"
    with pytest.raises(SamplingParamError, match="pools LAST"):
        PoolingParams(pooling_type="MEAN").resolved(PoolerConfig("LAST", True, 576, ("LAST",)))
    for bad in (PoolingParams(dimensions=0), PoolingParams(truncate_prompt_tokens=0), PoolingParams(pooling_type="MAX")):
        with pytest.raises(SamplingParamError):
            bad.validate()


def test_base64_is_little_endian_float32():
    v = [0.1, -2.5, 3.0e-8, 1.0]
    dec = np.frombuffer(base64.b64decode(encode_vector(v, "base64")), dtype="<f4")
    assert np.array_equal(dec, np.asarray(v, dtype=np.float32))
    assert encode_vector(v, "float") == v


def test_pairs_and_cosine():
    assert pair_texts("q", ["a", "b"]) == (["q", "q"], ["a", "b"])
    assert pair_texts(["x", "y"], ["a", "b"]) == (["x", "y"], ["a", "b"])
    with pytest.raises(ValueError):
        pair_texts(["x", "y"], ["a", "b", "c"])
    with pytest.raises(ValueError):
        pair_texts([], "a")
    assert cosine([1, 0], [0, 1]) == 0.0 and cosine([1, 1], [2, 2]) == pytest.approx(1.0)
    assert cosine([0, 0], [1, 1]) == 0.0


@pytest.mark.parametrize("flags, runner", [
    ([], "auto"), (["--task", "embed"], "pooling"), (["--task", "score"], "pooling"),
    (["--task", "generate"], "generate"), (["--runner", "pooling"], "pooling"),
    (["--runner", "generate", "--task", "embed"], "generate"),  # --runner wins, as in vLLM
])
def test_task_and_runner_flags(flags, runner):
    """vLLM's older ``--task embed`` / ``score`` mean ``--runner pooling``."""
    import argparse

    from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_args_from_cli(p.parse_args(["some-model", *flags])).runner == runner
