"""Counters of data-parallel replicas: summed for ``/stats`` and ``/metrics``, and one entry per
replica (``engine/dp_client.py``)."""

from __future__ import annotations

import msgspec

from pagedllm.stats import SchedulerStats, StepTimings

# counters and pool sizes that add up across replicas
_SUMMED = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_prompt_tokens", "num_video_tokens_pruned",
           "num_generation_tokens", "num_computed_tokens", "num_steps", "spec_num_drafts", "spec_num_draft_tokens",
           "spec_num_accepted_tokens")
_GAUGES = ("num_running", "num_waiting", "num_free_blocks", "num_blocks")  # of live replicas only
_TIMES = ("schedule_s", "prepare_s", "execute_s", "sample_s", "update_s", "idle_s")


def _merge_timings(timings: list[StepTimings]) -> StepTimings:
    """Totals and steps summed; means and the idle fraction recomputed from the sums."""
    tot = {k: sum(getattr(t, k) for t in timings) for k in _TIMES}
    steps = sum(t.steps for t in timings)
    means = {f"mean_{k}": (v / steps if steps else 0.0) for k, v in tot.items()}
    busy = tot["idle_s"] + tot["execute_s"] + tot["sample_s"]
    return StepTimings(**tot, **means, steps=steps, idle_fraction=tot["idle_s"] / busy if busy else 0.0)


def merge_stats(stats: list[SchedulerStats], alive: list[bool]) -> SchedulerStats:
    """One ``SchedulerStats`` for the whole engine from each replica's.

    Counters (tokens, prefix-cache queries and hits, preemptions, steps, drafts) are summed over
    every replica, dead ones included, so that they never go down; gauges (running, waiting,
    blocks, ``kv_cache_usage`` weighted by pool size, ``block_states`` concatenated) cover live
    replicas only. ``core_pid`` is ``None`` (each replica's is in ``replica_entry``); the weight
    description is the first replica's (they load the same model).

    Args:
        stats: one per replica, in replica order (at least one).
        alive: whether each replica still runs.
    """
    live = [s for s, a in zip(stats, alive) if a]
    out = {k: sum(getattr(s, k) for s in stats) for k in _SUMMED}
    out.update({k: sum(getattr(s, k) for s in live) for k in _GAUGES})
    blocks = out["num_blocks"]
    out["kv_cache_usage"] = sum(s.kv_cache_usage * s.num_blocks for s in live) / blocks if blocks else 0.0
    out["max_num_running"] = max(s.max_num_running for s in stats)
    out["block_states"] = "".join(s.block_states for s in live)
    width = max(len(s.spec_accepted_per_position) for s in stats)
    out["spec_accepted_per_position"] = [sum(s.spec_accepted_per_position[p] for s in stats
                                             if p < len(s.spec_accepted_per_position)) for p in range(width)]
    out["step_timings"] = _merge_timings([s.step_timings for s in stats])
    first = stats[0]
    return SchedulerStats(cpu_kernels=first.cpu_kernels, weight_formats=dict(first.weight_formats),
                          weight_kernels=first.weight_kernels, core_pid=None, **out)


def replica_entry(index: int, stats: SchedulerStats, router, pid: int, error: str | None) -> dict:
    """One replica's line of ``/stats``'s ``replicas`` list: its counters (gauges 0 once dead) and
    the router's view of it.

    Args:
        index: the replica's index.
        stats: its last counters.
        router: the ``PrefixRouter`` (for ``alive``, ``in_flight``, ``routed``, ``prefix_routed``).
        pid: its core process id.
        error: why it died, or ``None``.
    """
    alive = router.alive[index]
    if not alive:
        stats = msgspec.structs.replace(stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)
    d = msgspec.structs.replace(stats, core_pid=pid).to_dict()
    d.update(replica=index, alive=alive, in_flight=router.in_flight[index], routed=router.routed[index],
             prefix_routed=router.prefix_routed[index], error=error)
    return d
