/* Which of the kernels' instruction-set builds this CPU and OS can run (issue 37).
 *
 * Compiled on its own with no target flags (the x86-64 baseline), so that asking never executes an
 * instruction the CPU may lack. A feature counts only when the CPU reports it (cpuid) and the OS
 * saves its registers on a context switch (XCR0, read with xgetbv once cpuid says OSXSAVE): a CPU
 * can list AVX-512 while a hypervisor or kernel leaves the ZMM state off, and then the first
 * AVX-512 instruction faults. Bits from the Intel SDM vol. 2A (CPUID leaves 1 and 7) and vol. 1
 * 13.3 (XCR0: bit 1 SSE, 2 AVX, 5-7 opmask and the upper ZMM halves).
 *
 * pl_cpu_isa() returns the highest tier:
 *   3 avx512vnni: AVX-512 F, BW, VL, DQ and VNNI, with AVX2 and FMA;
 *   2 avxvnni:    AVX2, FMA and the VEX-encoded AVX-VNNI (Alder Lake and later clients);
 *   1 avx2:       AVX2 and FMA (Haswell, Zen 1-3);
 *   0 generic:    anything else (and every non-x86 CPU).
 * The tiers are not nested: a Zen 4 runs avx512vnni but has no AVX-VNNI (Zen 5 and Intel cores
 * since Alder Lake / Sapphire Rapids have both), so pl_cpu_isa_mask() says which builds run, one
 * bit per tier.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <stdint.h>

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int has_avxvnni(void) {
    unsigned a, b, c, d, a1 = 0, b1, c1, d1;
    if (__get_cpuid_max(0, 0) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (a >= 1) /* leaf 7's highest sub-leaf */
        __cpuid_count(7, 1, a1, b1, c1, d1);
    return (a1 >> 4) & 1; /* AVX-VNNI: VEX vpdpbusd on YMM, no new register state */
}

int pl_cpu_isa(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    if (!osxsave || !avx || (xcr0() & 0x6) != 0x6) /* the OS saves no YMM state: SSE only */
        return 0;
    unsigned max_leaf = __get_cpuid_max(0, 0);
    if (max_leaf < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1;
    if (!avx2 || !fma)
        return 0;
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1, vnni512 = (c >> 11) & 1;
    if (f && dq && bw && vl && vnni512 && (xcr0() & 0xe0) == 0xe0)
        return 3;
    unsigned a1 = 0, b1, c1, d1;
    if (a >= 1) /* leaf 7's highest sub-leaf */
        __cpuid_count(7, 1, a1, b1, c1, d1);
    if ((a1 >> 4) & 1) /* AVX-VNNI: VEX vpdpbusd on YMM, no new register state */
        return 2;
    return 1;
}

int pl_cpu_isa_mask(void) {
    int top = pl_cpu_isa(), mask = 1; /* generic always runs */
    if (top >= 1)
        mask |= 2; /* every tier above generic includes AVX2 and FMA */
    if (top >= 1 && has_avxvnni())
        mask |= 4;
    if (top == 3)
        mask |= 8;
    return mask;
}
#else
int pl_cpu_isa(void) { return 0; }
int pl_cpu_isa_mask(void) { return 1; }
#endif
