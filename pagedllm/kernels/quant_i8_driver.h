/* The int8-activation product's outer loops, shared by quant_avx512.c and quant_avx2.c (included
 * once by each, after it defines: qrow, qrow_bytes(K), quantize_row(x, K, mem, row, levels), QI_MAXR,
 * QI8_ONE_LEVEL (1: tile_i8 takes fmt | Q_LV1) and tile_i8(fmt, tile bytes, d, m, blocks, rows, R,
 * out[QI_MAXR][QT])). Every input row is quantized
 * once, then every tile multiplies the rows in passes of QI_MAXR: a row's arithmetic is the same
 * whatever else the batch holds. */
#ifndef PL_QUANT_I8_DRIVER_H
#define PL_QUANT_I8_DRIVER_H
#ifndef QI_CHUNK
#define QI_CHUNK 16
#endif

/* y rows [0, M) x tile t (output rows n0 .. n0 + nc) of format fmt, a constant once inlined */
static inline __attribute__((always_inline)) void tile_rows(int fmt, const uint8_t *tq, const float *dt,
                                                            const float *mt, long nb, const qrow *rows, long M,
                                                            const float *bias, float *y, long N, long n0) {
    long nc = N - n0 < QT ? N - n0 : QT;
    for (long r0 = 0; r0 < M; r0 += QI_MAXR) {
        long rc = M - r0 < QI_MAXR ? M - r0 : QI_MAXR;
        float out[QI_MAXR][QT];
        const qrow *xr = rows + r0;
        switch (rc) { /* constant R per call: the accumulators stay in registers */
#define QI_CASE(r) case r: tile_i8(fmt, tq, dt, mt, nb, xr, r, out); break;
        QI_CASE(1) QI_CASE(2) QI_CASE(3)
#if QI_MAXR > 4
        QI_CASE(4) QI_CASE(5) QI_CASE(6) QI_CASE(7)
#endif
        default: tile_i8(fmt, tq, dt, mt, nb, xr, QI_MAXR, out); break;
#undef QI_CASE
        }
        for (long i = 0; i < rc; i++)
            for (long j = 0; j < nc; j++) y[(r0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

/* The format's switch sits here, below the parallel region: GCC outlines an OpenMP region before it
 * inlines, so a format passed into the region stays a run-time value there and every format shared
 * one slow, unspecialised loop (measured: 2-3x slower products). */
static void tile_rows_fmt(int fmt, const uint8_t *tq, const float *dt, const float *mt, long nb, const qrow *rows,
                          long M, const float *bias, float *y, long N, long n0) {
#if QI8_ONE_LEVEL /* fmt | Q_LV1: the one-level kernels, their own specialisations */
    switch (fmt) {
    case 0 | Q_LV1: tile_rows(0 | Q_LV1, tq, dt, mt, nb, rows, M, bias, y, N, n0); return;
    case 2 | Q_LV1: tile_rows(2 | Q_LV1, tq, dt, mt, nb, rows, M, bias, y, N, n0); return;
    case 3 | Q_LV1: tile_rows(3 | Q_LV1, tq, dt, mt, nb, rows, M, bias, y, N, n0); return;
    case 4 | Q_LV1: tile_rows(4 | Q_LV1, tq, dt, mt, nb, rows, M, bias, y, N, n0); return;
    case 7 | Q_LV1: tile_rows(7 | Q_LV1, tq, dt, mt, nb, rows, M, bias, y, N, n0); return;
    case 6 | Q_LV1: tile_rows(6 | Q_LV1, tq, dt, mt, nb, rows, M, bias, y, N, n0); return;
    case 6 | Q_HALF | Q_LV1: tile_rows(6 | Q_HALF | Q_LV1, tq, dt, mt, nb, rows, M, bias, y, N, n0); return;
    default: fmt &= ~Q_LV1; /* the int16 formats: their residual is zero, the two-level kernel serves */
    }
#endif
    switch (fmt) {
    case 0: tile_rows(0, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 1: tile_rows(1, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 2: tile_rows(2, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 3: tile_rows(3, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 5: tile_rows(5, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 6: tile_rows(6, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
#if QI8_ISA != 3 /* U6H: quant_avx2.c only (pl_qgemm sends it to the float32 path on AVX-512) */
    case 7: tile_rows(7, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
#endif
    case 1 | Q_HALF: tile_rows(1 | Q_HALF, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 2 | Q_HALF: tile_rows(2 | Q_HALF, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 5 | Q_HALF: tile_rows(5 | Q_HALF, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    case 6 | Q_HALF: tile_rows(6 | Q_HALF, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    default: tile_rows(4, tq, dt, mt, nb, rows, M, bias, y, N, n0); break;
    }
}

void pl_qgemm_i8(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
                 const float *bias, float *y, long N, long K, int nt, int lv) {
#if QI8_ONE_LEVEL
    int tf = lv == 1 ? fmt | Q_LV1 : fmt; /* the tiles' kernel */
#else
    int tf = fmt;
    lv = 2;
#endif
    long nb = K / QBLOCK, tiles = (N + QT - 1) / QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    size_t rb = (qrow_bytes(K) + 63) & ~(size_t)63;
    uint8_t *mem = malloc(rb * M);
    qrow *rows = malloc(sizeof(qrow) * M);
    if (!mem || !rows) { /* out of memory: the float32 path needs no scratch */
        free(mem);
        free(rows);
        pl_qgemm_f32(fmt, x, M, qs, d, mn, bias, y, N, K, nt);
        return;
    }
    /* a few rows (decode) are quantized by this thread before the team starts: a barrier costs more */
    if (M <= 4)
        for (long i = 0; i < M; i++) quantize_row(x + i * K, K, mem + i * rb, rows + i, lv);
    #pragma omp parallel num_threads(nt)
    {
        if (M > 4) {
            #pragma omp for schedule(static)
            for (long i = 0; i < M; i++) quantize_row(x + i * K, K, mem + i * rb, rows + i, lv);
        }
        /* rows in chunks of QI_CHUNK (their quantized levels stay in L2 while every tile passes by) */
        for (long r0 = 0; r0 < M; r0 += QI_CHUNK) {
            long rc = M - r0 < QI_CHUNK ? M - r0 : QI_CHUNK;
            #pragma omp for schedule(static)
            for (long t = 0; t < tiles; t++)
                tile_rows_fmt(tf, qs + t * nb * tbb, q_dat(fmt, d, t * ng * QT), mn ? mn + t * nb * QT : NULL, nb,
                              rows + r0, rc, bias, y + r0 * N, N, t * QT);
        }
    }
    free(mem);
    free(rows);
}
#endif
