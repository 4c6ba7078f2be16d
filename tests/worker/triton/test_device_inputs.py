"""Device-side input preparation (``worker/device/device_inputs.py``) equals the host (numpy) preparation.

A randomized scheduler drives one ``InputBatch`` through many steps: new requests
(some with prefix-cache hits, some re-admitted after preemption with their outputs),
chunked prefills, decodes whose last token is already recorded, decodes whose last
token is the previous step's sample (a placeholder, async scheduling), decodes with
draft tokens and their verdicts, requests skipped for a step, finished requests whose
slots are reused. Every step, the kernels' ``input_ids``, ``positions`` and metadata
must equal ``HostInputs.gather`` with the placeholders filled as the host
path fills them, on block sizes 16 and 32.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.attention.triton_paged import TritonPagedBackend
from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.device.device_inputs import DeviceInputs
from pagedllm.worker.input_batch import InputBatch
from pagedllm.distributed.micro_batch import step_metadata
from pagedllm.worker.step_inputs import HostInputs

MAX_LEN = 150
SLOTS = 5
CPU = torch.device("cpu")


class Sim:
    """A scheduler's view of the requests: what it sends, and what the step samples."""

    def __init__(self, rng: np.random.Generator, block_size: int) -> None:
        self.rng, self.bs = rng, block_size
        self.batch = InputBatch(SLOTS, MAX_LEN, block_size)
        self.reqs: dict[str, dict] = {}
        self.next_id, self.next_block = 0, 1
        self.unrecorded: dict[str, tuple[int, int]] = {}  # sampled by the last step, not yet in the batch
        self.hits = self.readmits = 0

    def _blocks(self, k: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + k))
        self.next_block += k
        return [int(i) for i in self.rng.permutation(ids)]  # not in order: the table matters

    def admit(self) -> None:
        rng = self.rng
        done = [r for r, q in self.reqs.items() if rng.random() < 0.08 or len(q["tokens"]) > MAX_LEN - 12]
        for rid in done:  # finished or preempted
            req = self.reqs.pop(rid)
            self.batch.remove(rid)
            self.unrecorded.pop(rid, None)
            if rng.random() < 0.5 and len(req["tokens"]) < MAX_LEN - 40:
                self._add(f"{rid}+", req["tokens"], req["prompt_len"], 0)  # re-admitted: prompt + outputs
                self.readmits += 1
        while len(self.reqs) < SLOTS and rng.random() < 0.6:
            prompt = rng.integers(1, 50000, int(rng.integers(1, 70))).tolist()
            hit = self.bs * int(rng.integers(0, (len(prompt) - 1) // self.bs + 1))  # prefix-cache hit
            self._add(f"r{self.next_id}", prompt, len(prompt), hit)
            self.hits += hit > 0
            self.next_id += 1

    def _add(self, rid: str, tokens: list[int], prompt_len: int, computed: int) -> None:
        blocks = self._blocks(-(-max(computed, 1) // self.bs))
        self.batch.add(NewRequestData(rid, list(tokens), prompt_len, SamplingParams(), blocks, computed))
        self.reqs[rid] = dict(tokens=list(tokens), prompt_len=prompt_len, computed=computed, blocks=blocks)

    def schedule(self):
        """Pick each request's tokens; returns ``(rids, n, spec, pend, pending_src)``."""
        rng, b = self.rng, self.batch
        rids, n, spec, pend, src = [], [], [], [], []
        self.known = []
        for rid, req in self.reqs.items():
            known = len(req["tokens"])
            d = 0
            if rid in self.unrecorded:  # its last token is a placeholder: the last step's sample
                assert req["computed"] == known
                pend.append(len(rids))
                src.append(self.unrecorded[rid][0])
                cnt = 1
            elif rng.random() < 0.15:
                continue  # not scheduled this step
            elif known - req["computed"] == 1 and rng.random() < 0.3:
                d = int(rng.integers(1, 5))  # a decode with drafts written after its known tokens
                b.token_ids[b.slot_of[rid], known:known + d] = rng.integers(1, 50000, d)
                cnt = 1 + d
            else:
                cnt = int(rng.integers(1, min(known - req["computed"], 40) + 1))
            end = req["computed"] + cnt
            need = -(-end // self.bs) - len(req["blocks"])
            new = self._blocks(need) if need > 0 else []
            req["blocks"] += new
            b.update(CachedRequestData(rid, new, req["computed"]))
            rids.append(rid)
            n.append(cnt)
            spec.append(d)
            self.known.append(known)
        return rids, np.array(n, np.int64), np.array(spec, np.int64), np.array(pend, np.int64), np.array(src, np.int64)

    def finish_step(self, rids, n, spec) -> np.ndarray:
        """The step's results: the last step's placeholders are recorded now, then this step samples
        (a token recorded at once, or left for the next step as a placeholder) and verifies drafts.
        Returns the step's sampled ids in sample order (the next step's ``prev``)."""
        rng, b = self.rng, self.batch
        for rid, (_, tok) in self.unrecorded.items():
            if rid in self.reqs:
                b.append_tokens([rid], [tok])
                self.reqs[rid]["tokens"].append(tok)
        self.unrecorded = {}
        sampled = []
        for rid, cnt, d, known in zip(rids, n.tolist(), spec.tolist(), self.known):
            req = self.reqs[rid]
            end = req["computed"] + cnt
            req["computed"] = end
            if end < known + d:
                continue  # a prefill chunk short of the prompt's end samples nothing
            if d:  # the verdict: e tokens emitted, the rejected drafts' KV recomputed later
                toks = rng.integers(1, 50000, int(rng.integers(1, d + 2))).tolist()
                b.extend_tokens(rid, toks)
                req["tokens"] += toks
                req["computed"] = end - (d + 1 - len(toks))
                sampled.append(toks[-1])
                continue
            tok = int(rng.integers(1, 50000))
            sampled.append(tok)
            if rng.random() < 0.5:
                b.append_tokens([rid], [tok])
                req["tokens"].append(tok)
            else:
                self.unrecorded[rid] = (len(sampled) - 1, tok)
        return np.array(sampled or [0], np.int64)


def _host_reference(batch, backend, slots, n, start, end, pend, pending_src, prev):
    """The host path: ``HostInputs.gather`` with the placeholders filled as ``_run`` fills them."""
    qsl = np.zeros(n.size + 1, np.int64)
    np.cumsum(n, out=qsl[1:])
    ns = SimpleNamespace(input_batch=batch, block_size=batch.block_size, attention_backend=backend,
                         metadata=step_metadata)
    ids, pos, meta = HostInputs.gather(ns, slots, n, start, end, qsl)
    ids = ids.copy()
    if pend.size:
        ids[qsl[1:][pend] - 1] = prev[pending_src]
    return ids, pos, meta


@pytest.mark.parametrize("block_size,seed", [(16, 0), (32, 1), (16, 2)])
def test_device_inputs_equal_host_preparation(block_size, seed):
    rng = np.random.default_rng(seed)
    sim = Sim(rng, block_size)
    backend = TritonPagedBackend(CPU)
    dev = DeviceInputs(sim.batch, backend, CPU)
    prev = np.zeros(1, np.int64)
    seen = dict(pending=0, drafts=0, prefill=0)
    for step in range(30):
        sim.admit()
        rids, n, spec, pend, pending_src = sim.schedule()
        if not rids:
            continue
        b = sim.batch
        slots = np.array([b.slot_of[r] for r in rids], np.int64)
        start = b.num_computed_tokens[slots].copy()
        end = start + n
        plan, (extra,) = dev.prepare(slots, n, start, end, spec, pend, pending_src, [np.arange(3, dtype=np.int64)])
        want_ids, want_pos, want = _host_reference(b, backend, slots, n, start, end, pend, pending_src, prev)
        ids, pos, got = dev.materialize(plan, torch.from_numpy(prev))
        assert extra.tolist() == [0, 1, 2]
        assert ids.tolist() == want_ids.tolist(), f"step {step}"
        assert pos.tolist() == want_pos.tolist()
        for name in ("slot_mapping", "query_start_loc", "num_computed", "seq_lens", "decode_req", "tile_req", "tile_q0"):
            assert getattr(got, name).tolist() == getattr(want, name).tolist(), f"step {step}: {name}"
        assert (got.num_splits, got.split_len, got.block_q) == (want.num_splits, want.split_len, want.block_q)
        own = -(-end // block_size)  # columns past a request's context are never read
        for i in range(len(rids)):
            assert got.block_tables[i, :own[i]].tolist() == want.block_tables[i, :own[i]].tolist()
        assert dev.num_computed[torch.from_numpy(slots)].tolist() == end.tolist()
        seen["pending"] += pend.size
        seen["drafts"] += int((spec > 0).sum())
        seen["prefill"] += int((n > 1).sum())
        prev = sim.finish_step(rids, n, spec)
    seen.update(hits=sim.hits, readmits=sim.readmits, slots_reused=int((sim.batch.generation > 1).sum()))
    assert all(seen.values()), seen  # every case was exercised
