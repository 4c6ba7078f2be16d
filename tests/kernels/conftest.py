"""The kernels' instruction-set builds the tests run on: every one this CPU can run (issue 37)."""

from __future__ import annotations

import pytest

from pagedllm.kernels import cpu


def pytest_generate_tests(metafunc) -> None:
    """Parametrize ``isa_build`` with every build this CPU runs, highest first (the build the engine
    loads by default, then each lower one forced). Asked at collection, after the root conftest's
    ``pytest_configure`` set the environment the kernels load with."""
    if "isa_build" in metafunc.fixturenames:
        from pagedllm.kernels.cpu_features import runnable_isas
        isas = list(reversed(runnable_isas())) if cpu.available() else ["generic"]
        metafunc.parametrize("isa_build", isas, indirect=True)


@pytest.fixture
def isa_build(request, monkeypatch) -> str:
    """Swap the loaded kernels for build ``request.param`` (as ``PAGEDLLM_CPU_ISA`` would) for one test;
    the default build is left in place. Returns the build's name."""
    if request.param != cpu.isa():
        monkeypatch.setattr(cpu, "_lib", cpu.load(cpu.build(isa=request.param)))
    return request.param
