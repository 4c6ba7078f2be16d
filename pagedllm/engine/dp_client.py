"""Data parallelism: N engine cores behind one front end (``--data-parallel-size``, vLLM's name).

Each replica is an engine core in its own process (``MPEngineCoreClient``) with its own copy of
the weights and its own KV pool of ``--kv-cache-memory``; the front end (tokenizer, output
processor, HTTP) is one. ``DPClient`` (synchronous, for ``LLMEngine``) and ``AsyncDPClient``
(asyncio, for ``AsyncLLM``: ``DPClient.make_async()``) implement the ``EngineCoreClient`` and
``AsyncEngineCoreClient`` meanings over the replicas (vLLM's ``DPAsyncMPClient``):

* ``add_request`` asks the ``PrefixRouter`` (``engine/router.py``) for a replica: the one that
  was sent the longest prefix of the prompt's KV blocks beyond the prefix most recent prompts
  share (a chat template, a common system prompt), else the least loaded; the request id is
  then mapped to it, so aborts and stop-string finishes go to the right core.
* ``get_output`` merges the replicas' step outputs as they come.
* A replica that dies is skipped from then on; its requests in flight are handed back by
  ``pop_failed_requests`` with one clear message (the front end fails just those), and the
  others keep serving. Only when every replica is dead does ``get_output`` raise
  ``EngineDeadError`` and ``is_alive`` turn False (``/health`` then answers 503).
* ``get_stats`` sums the replicas' counters (``dp_stats.merge_stats``); ``replica_stats`` gives
  each replica's own, for ``/stats`` and ``/metrics``.

Replicas are processes only: in-process replicas would share one Python interpreter and its GIL
between N step loops, which is what data parallelism on a CPU is meant to avoid.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os

import zmq

from pagedllm.config import EngineArgs
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.core_client import MPEngineCoreClient
from pagedllm.engine.dp_stats import merge_stats, replica_entry
from pagedllm.engine.messages import EngineCoreRequest, EngineDeadError
from pagedllm.engine.router import PrefixRouter, prompt_block_hashes
from pagedllm.request import RequestStatus
from pagedllm.stats import SchedulerStats

logger = logging.getLogger(__name__)


def replica_args(args: EngineArgs) -> EngineArgs:
    """The ``EngineArgs`` one replica's core runs with: the same, but with ``num_threads`` unset
    split evenly between the replicas (CPUs this process may run on // replicas, at least 1), so
    that N cores do not each start a thread per CPU and oversubscribe them."""
    out = copy.copy(args)
    if out.num_threads is None:
        out.num_threads = max(1, len(os.sched_getaffinity(0)) // args.data_parallel_size)
    return out


class _DPBase:
    """The bookkeeping both DP clients share: routing, the request -> replica map, dead replicas.

    Args:
        replicas: one client per replica (``MPEngineCoreClient``, or its ``make_async()``).
        router: the routing policy and its per-replica state.
        block_size: tokens per KV block (for the prompt's block hashes).
        prefix_caching: whether the cores cache prefixes (else routing is by load only).
        pids: each replica's core process id.
        num_blocks: one replica's KV pool in blocks (the smallest): a request's context limit.
    """

    def __init__(self, replicas: list, router: PrefixRouter, block_size: int, prefix_caching: bool,
                 pids: list[int], num_blocks: int) -> None:
        self.replicas = replicas
        self.router = router
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pids = pids
        self.num_blocks = num_blocks
        self.owner: dict[str, int] = {}  # live request id -> replica index
        self.errors: list[str | None] = [None] * len(replicas)
        self.failed: dict[str, str] = {}  # request id -> error, until pop_failed_requests

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Route a request to a live replica and send it there.

        Raises:
            EngineDeadError: every replica has died.
        """
        lora = request.lora_request
        hashes = (prompt_block_hashes(request.prompt_token_ids, self.block_size, request.cache_salt,
                                      None if lora is None else lora.cache_key()) if self.prefix_caching else [])
        try:
            r = self.router.route(hashes)
        except RuntimeError:
            raise EngineDeadError("every data-parallel replica has died") from None
        self.owner[request.request_id] = r
        self.replicas[r].add_request(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests in the replicas that hold them (unknown or finished ids are ignored)."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            r = self.owner.pop(rid, None)
            if r is not None:
                self.router.finished(r)
                by_replica.setdefault(r, []).append(rid)
        for r, rids in by_replica.items():
            if self.router.alive[r]:
                self.replicas[r].abort_requests(rids, status)

    def _note(self, outs: list[EngineCoreOutput]) -> None:
        """Forget finished requests, so the router's in-flight counts fall."""
        for o in outs:
            if o.finish_reason is not None:
                r = self.owner.pop(o.request_id, None)
                if r is not None:
                    self.router.finished(r)

    def _replica_died(self, r: int, err: BaseException) -> None:
        """Stop routing to replica ``r`` and fail its requests in flight.

        Raises:
            EngineDeadError: it was the last live replica.
        """
        msg = f"data-parallel replica {r} (engine core pid {self.pids[r]}) died: {err}"
        self.errors[r] = msg
        self.router.mark_dead(r)
        lost = [rid for rid, owner in self.owner.items() if owner == r]
        for rid in lost:
            del self.owner[rid]
            self.failed[rid] = msg
        live = sum(self.router.alive)
        logger.error("%s; %d requests failed, %d of %d replicas left", msg, len(lost), live, len(self.replicas))
        if not live:
            raise EngineDeadError(f"every data-parallel replica has died (last: {msg})")

    def pop_failed_requests(self) -> dict[str, str]:
        """Requests whose replica died since the last call, each with the error message."""
        out, self.failed = self.failed, {}
        return out

    # ---- state ---------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        """True while at least one replica lives."""
        return any(self.router.alive[i] and r.is_alive() for i, r in enumerate(self.replicas))

    def replica_stats(self) -> list[dict]:
        """Each replica's counters (``SchedulerStats`` as a dict) with ``replica`` (index), ``alive``,
        ``core_pid``, ``in_flight``, ``routed``, ``prefix_routed`` (requests sent for a remembered
        prefix) and ``error`` (why it died, else ``None``)."""
        return [replica_entry(i, self._stats_of(i), self.router, self.pids[i], self.errors[i])
                for i in range(len(self.replicas))]

    def _stats_of(self, i: int) -> SchedulerStats:
        return self.replicas[i].get_stats()

    def get_stats(self) -> SchedulerStats:
        """The replicas' counters summed (gauges of dead replicas count as 0; their counters stay)."""
        return merge_stats([self._stats_of(i) for i in range(len(self.replicas))], self.router.alive)

    def settle(self) -> None:
        """Nothing to do: the core processes step by themselves."""

    def shutdown(self) -> None:
        """Stop and reap every replica's process (safe to call twice)."""
        for r in self.replicas:
            r.shutdown()


class DPClient(_DPBase):
    """An ``EngineCoreClient`` over ``args.data_parallel_size`` core processes (``LLMEngine``'s).

    The replicas load their models at the same time; if one fails to start, all are stopped.

    Args:
        args, model_dir, max_model_len, eos_token_ids: as ``MPEngineCoreClient`` (each replica
            runs with ``replica_args(args)``).
        startup_timeout_s: how long each replica may take to load (seconds).
        balance_abs_threshold: see ``PrefixRouter``.
    Raises:
        EngineDeadError: a replica failed to start (its error in the message).
    """

    def __init__(self, args: EngineArgs, model_dir, max_model_len: int, eos_token_ids: set[int],
                 startup_timeout_s: float = 600.0, balance_abs_threshold: int = 32) -> None:
        rargs = replica_args(args)
        clients: list[MPEngineCoreClient] = []
        try:
            for _ in range(args.data_parallel_size):
                clients.append(MPEngineCoreClient(rargs, model_dir, max_model_len, eos_token_ids,
                                                  startup_timeout_s, wait=False))
            for i, c in enumerate(clients):
                try:
                    c.wait_ready(startup_timeout_s)
                except EngineDeadError as e:
                    raise EngineDeadError(f"data-parallel replica {i} failed to start: {e}") from None
        except BaseException:
            for c in clients:
                c.shutdown()
            raise
        router = PrefixRouter(len(clients), capacity_blocks=min(c.num_blocks for c in clients),
                              balance_abs_threshold=balance_abs_threshold)
        super().__init__(clients, router, args.block_size, args.enable_prefix_caching,
                         [c.core_pid for c in clients], min(c.num_blocks for c in clients))

    def get_output(self, timeout_ms: int = 100) -> list[EngineCoreOutput]:
        """Every step output the live replicas have sent (waiting up to ``timeout_ms`` for the first).

        Raises:
            EngineDeadError: every replica has died.
        """
        live = [i for i in range(len(self.replicas)) if self.router.alive[i]]
        if not live:
            raise EngineDeadError("every data-parallel replica has died")
        if not any(self.replicas[i].has_pending_outputs() for i in live):  # outputs kept by call_utility come first
            poller = zmq.Poller()
            for i in live:
                poller.register(self.replicas[i].output_socket, zmq.POLLIN)
            poller.poll(timeout_ms)
        outs: list[EngineCoreOutput] = []
        for i in live:
            try:
                got = self.replicas[i].get_output(0)
            except EngineDeadError as e:
                self._replica_died(i, e)
                continue
            self._note(got)
            outs.extend(got)
        return outs

    def call_utility(self, name: str, *args):
        """Run ``EngineCore.<name>(*args)`` in every live replica; returns their results as a list
        (replica order, dead replicas left out).

        Raises:
            ValueError: a replica refused or failed the call.
            EngineDeadError: a replica died or did not answer.
        """
        return [self.replicas[i].call_utility(name, *args)
                for i in range(len(self.replicas)) if self.router.alive[i]]

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds, in every live replica; returns how many in all."""
        return sum(int(n) for n in self.call_utility("reset_prefix_cache"))

    def make_async(self) -> AsyncDPClient:
        """An ``AsyncDPClient`` over these replicas (it takes over their output sockets)."""
        return AsyncDPClient(self)


class AsyncDPClient(_DPBase):
    """The asyncio client over a ``DPClient``'s replicas (``AsyncLLM``'s, an
    ``AsyncEngineCoreClient``); it takes over their output sockets (each replica's
    ``make_async()``) and the router, so use the ``DPClient`` no more for outputs.

    Args:
        sync: the ``DPClient`` that started the replicas.
    """

    def __init__(self, sync: DPClient) -> None:
        super().__init__([r.make_async() for r in sync.replicas], sync.router, sync.block_size,
                         sync.prefix_caching, sync.pids, sync.num_blocks)
        self.owner, self.errors, self.failed = sync.owner, sync.errors, sync.failed
        self._reads: dict[int, asyncio.Task] = {}

    async def get_output(self) -> list[EngineCoreOutput]:
        """The outputs of whichever replicas sent some first (possibly none, when a replica has
        just died: its requests are then in ``pop_failed_requests``).

        Raises:
            EngineDeadError: every replica has died.
        """
        live = [i for i in range(len(self.replicas)) if self.router.alive[i]]
        if not live:
            raise EngineDeadError("every data-parallel replica has died")
        for i in live:
            if i not in self._reads:
                self._reads[i] = asyncio.ensure_future(self.replicas[i].get_output())
        try:
            await asyncio.wait(list(self._reads.values()), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for t in self._reads.values():
                t.cancel()
            self._reads.clear()
            raise
        outs: list[EngineCoreOutput] = []
        for i, task in list(self._reads.items()):
            if not task.done():
                continue
            del self._reads[i]
            try:
                got = task.result()
            except EngineDeadError as e:
                self._replica_died(i, e)
                continue
            self._note(got)
            outs.extend(got)
        return outs
