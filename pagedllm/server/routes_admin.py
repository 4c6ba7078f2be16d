"""The operational routes: ``/health`` and ``/ping`` (probes), ``/stats``, ``/metrics`` and ``/version``.

As vLLM's server: ``/health`` and ``/ping`` answer 200 or 503 with an empty body, ``/metrics``
the Prometheus text format (``server.metrics``), ``/version`` the package version; ``/stats`` (not
part of any API) the engine counters of ``LLMEngine.get_stats`` as JSON, for debugging and tests.
All of them are open without the API key (``server.middleware.OPEN_PATHS``).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.server.metrics import ServerMetrics


def admin_router(llm: AsyncLLM, metrics: ServerMetrics) -> APIRouter:
    """The probe, statistics and version routes.

    Args:
        llm: the engine front door (its health and counters).
        metrics: the Prometheus collectors ``/metrics`` renders.
    """
    router = APIRouter()

    # one route per method: each operation has its own OpenAPI operation id
    @router.get("/health")
    @router.head("/health")
    async def health() -> Response:
        """200 while the engine loop runs, 503 once it has died (with data parallelism: 200 while
        any replica lives; ``/stats``'s ``replicas`` tells which are dead)."""
        return Response(status_code=200 if llm.is_healthy else 503)

    @router.get("/ping")
    @router.post("/ping")
    async def ping() -> Response:
        """``/health`` under the name load balancers and SageMaker probe (vLLM serves both)."""
        return Response(status_code=200 if llm.is_healthy else 503)

    @router.get("/stats")
    async def stats() -> dict:
        """Debugging aid: the engine counters as of the last step (see ``LLMEngine.get_stats``); with
        data parallelism they are summed over the replicas and ``replicas`` lists each one's; ``plan``
        is the engine plan (``EnginePlan.to_dict``: every decision made at start-up)."""
        out = llm.get_stats().to_dict()
        out["plan"] = llm.plan.to_dict()
        replicas = llm.replica_stats()
        if replicas:
            out["replicas"] = replicas
        return out

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text format (0.0.4) of ``ServerMetrics``: engine gauges and counters, latency histograms."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @router.get("/version")
    async def version() -> dict:
        """``{"version": pagedllm.__version__}``."""
        return {"version": pagedllm.__version__}

    return router
