"""``/metrics`` with data-parallel replicas: the summed series keep their names, each replica gets
``pagedllm:replica_*`` series labelled ``replica`` (``server/metrics.py``), and the text parses."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.dp_stats import merge_stats, replica_entry
from pagedllm.engine.router import PrefixRouter
from pagedllm.server.metrics import ServerMetrics
from pagedllm.stats import SchedulerStats


class _FakeDPLLM:
    """What ``ServerMetrics`` uses of ``AsyncLLM``, over two replicas (the second dead)."""

    def __init__(self) -> None:
        self.per = [SchedulerStats(num_running=3, num_blocks=100, num_free_blocks=40, kv_cache_usage=0.6,
                                   prefix_cache_hits=160, num_generation_tokens=50),
                    SchedulerStats(num_running=2, num_blocks=100, num_free_blocks=100, prefix_cache_hits=32,
                                   num_generation_tokens=7)]
        self.router = PrefixRouter(2, capacity_blocks=10)
        for _ in range(5):
            self.router.route([])  # no prefix: by load, in turn (3 to replica 0, 2 to replica 1)
        self.router.mark_dead(1)

    def get_stats(self) -> SchedulerStats:
        return merge_stats(self.per, self.router.alive)

    def replica_stats(self) -> list[dict]:
        return [replica_entry(i, s, self.router, 1000 + i, None if i == 0 else "gone") for i, s in enumerate(self.per)]

    def add_finished_callback(self, fn) -> None:
        pass


def test_summed_and_per_replica_series():
    body, _ = ServerMetrics(_FakeDPLLM(), "m").render()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}

    def v(name: str, replica: str | None = None) -> float:
        labels = {"model_name": "m", **({"replica": replica} if replica is not None else {})}
        return samples[(name, tuple(sorted(labels.items())))]

    assert v("pagedllm:num_requests_running") == 3  # the dead replica's gauges leave the sum
    assert v("pagedllm:prefix_cache_hits_total") == 192  # its counters stay
    assert v("pagedllm:generation_tokens_total") == 57
    assert (v("pagedllm:replica_up", "0"), v("pagedllm:replica_up", "1")) == (1.0, 0.0)
    assert (v("pagedllm:replica_routed_requests_total", "0"), v("pagedllm:replica_routed_requests_total", "1")) \
        == (3.0, 2.0)
    assert v("pagedllm:replica_num_requests_running", "0") == 3 and v("pagedllm:replica_num_requests_running", "1") == 0
    assert v("pagedllm:replica_prefix_cache_hits_total", "1") == 32
    assert v("pagedllm:replica_kv_cache_usage_perc", "0") == 0.6
