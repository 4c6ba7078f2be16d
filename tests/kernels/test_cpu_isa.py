"""The kernels' run-time choice of instruction-set build (issue 37) and what the CPU and OS allow:
cpuid/XSAVE probing, ``PAGEDLLM_CPU_ISA``, one build per instruction set, AMX's OS permission."""

from __future__ import annotations


import pytest
import torch

from pagedllm.kernels import cpu, cpu_features

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="CPU kernels off (PAGEDLLM_CPU_KERNELS=0) or no C compiler")


def test_the_default_build_is_the_best_this_cpu_runs():
    assert cpu.isa() == cpu_features.detected_isa()
    assert cpu_features.runnable_isas()[-1] == cpu.isa() and cpu_features.runnable_isas()[0] == "generic"
    flags = cpu_features.cpu_flags()
    if cpu._x86() and {"avx2", "fma"} <= flags:  # the OS view in /proc/cpuinfo agrees with the probe
        assert cpu.isa() != "generic"
    if "avx512_vnni" not in flags:
        assert cpu.isa() != "avx512vnni"


@pytest.mark.parametrize("isa", cpu_features.runnable_isas())
def test_each_build_reports_its_instruction_set(isa):
    """A build's own QI8_ISA (pl_isa) is the one asked for: the flags reach the compiler."""
    lib = cpu.load(cpu.build(isa=isa))
    assert cpu.ISAS[lib.pl_isa()] == isa


def test_every_build_compiles(tmp_path):
    """The builds this CPU cannot run (AVX-VNNI, AVX-512 VNNI on an AVX2 machine) still compile:
    their code is checked on every machine, if only by the compiler. They compile at ``-O0`` into a
    scratch cache: nothing runs them here, and the compiler's target checks (an intrinsic outside its
    build's flags fails to inline even at ``-O0``) are what matter; optimizing them took 100 s of the
    suite. The builds this CPU runs are built and run by the tests around this one."""
    from pagedllm.kernels import cpu_build
    if not cpu_build._x86():
        pytest.skip("one -march=native build off x86")
    flags = [("-O0" if f == "-O3" else f) for f in cpu_build._FLAGS]
    for isa in set(cpu.ISAS) - set(cpu_features.runnable_isas()):
        path = cpu_build.compile_library(cpu_build._SOURCES, [*flags, *cpu_build.ISA_FLAGS[isa]], f"check-{isa}",
                                         tmp_path, cpu_build._HEADERS)
        assert path.exists()


def test_pagedllm_cpu_isa_lowers_the_choice(monkeypatch):
    best = cpu_features.detected_isa()
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "generic")
    assert cpu_features.select_isa()[0] == "generic"
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "AVX512VNNI")  # case-insensitive; refused above the CPU's
    assert cpu_features.select_isa()[0] == best
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA"):
        cpu_features.select_isa()
    monkeypatch.delenv("PAGEDLLM_CPU_ISA")
    assert cpu_features.select_isa()[0] == best


def test_a_tier_the_cpu_skips_is_refused(monkeypatch):
    """A Zen 4 runs the AVX-512 VNNI build but has no AVX-VNNI: forcing ``avxvnni`` there would fault
    on its first vpdpbusd (it did, in CI), so it is refused like a tier above the CPU."""
    monkeypatch.setattr(cpu_features, "_probe", lambda: ("avx512vnni", ("generic", "avx2", "avx512vnni")))
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "avxvnni")
    isa, why = cpu_features.select_isa()
    assert isa == "avx512vnni" and "refused" in why and "avxvnni" not in cpu_features.runnable_isas()
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "avx2")
    assert cpu_features.select_isa()[0] == "avx2"


def test_a_forced_build_serves_and_says_so(monkeypatch):
    """``PAGEDLLM_CPU_ISA=generic`` in a fresh load: that build, float32 activations (it has no int8
    kernels), and ``quantized_kernels`` (the start-up log and ``/stats``) names it."""
    from pagedllm.models.quant_linear import quantized_kernels
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "generic")
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    assert cpu.available() and cpu.isa() == "generic"
    cpu.set_int8_activations(True)
    try:
        assert not cpu.int8_activations()
        assert "generic build" in quantized_kernels()
    finally:
        cpu.set_int8_activations(False)


def test_int8_activations_follow_the_build(monkeypatch):
    if cpu.isa() == "generic":
        pytest.skip("no int8 build on this CPU")
    cpu.set_int8_activations(True)
    try:
        from pagedllm.models.quant_linear import quantized_kernels
        assert cpu.int8_activations() and cpu.ISA_DOT[cpu.isa()] in quantized_kernels()
    finally:
        cpu.set_int8_activations(False)


def test_amx_needs_the_os_permission(monkeypatch):
    """AMX flags alone are not enough: a refused ``arch_prctl`` means no AMX (float32 everywhere)."""
    from pagedllm.kernels import cpu_features
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: {"amx_tile", "amx_bf16", "avx512f"})

    class RefusingLibc:
        def syscall(self, *args):
            return -1
    monkeypatch.setattr(cpu_features.ctypes, "CDLL", lambda *a, **k: RefusingLibc())
    cpu_features.amx_usable.cache_clear()
    try:
        assert cpu_features.amx_usable() is False
        assert cpu_features.auto_dtype()[0] == torch.float32
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: {"avx2"})
        cpu_features.amx_usable.cache_clear()
        assert cpu_features.amx_usable() is False
    finally:
        cpu_features.amx_usable.cache_clear()



def test_a_failed_build_names_the_compiler_error_and_leaves_no_file(tmp_path):
    """Sources compile one per core, then link: a source that does not compile is a RuntimeError with
    the compiler's message, and neither the library nor its objects are left behind."""
    from pagedllm.kernels.cpu_build import compile_library
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int pl_good(void) { return 7; }\n")
    bad.write_text("int pl_bad(void) { return }\n")
    with pytest.raises(RuntimeError, match="(?s)compiling broken failed:.*bad.c"):
        compile_library([good, bad], ["-O1", "-fPIC", "-shared"], "broken", tmp_path)
    assert list((tmp_path / "kernels").iterdir()) == []
    import ctypes
    lib = ctypes.CDLL(str(compile_library([good], ["-O1", "-fPIC", "-shared"], "fine", tmp_path)))
    assert lib.pl_good() == 7
