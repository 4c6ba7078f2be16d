"""Speculative decoding: proposers, the per-step depth rule, and the scheduler's side of it.

Drafts are proposed on the engine core's thread from each request's committed tokens
(``proposers.py``), sized per request and step by ``depth.py``, scheduled as extra tokens of
the request's step (``scheduler.py``: ``SpecDecoding``), and verified in the target's forward
pass by exact rejection sampling (``pagedllm/worker/spec_verify.py``).
"""
