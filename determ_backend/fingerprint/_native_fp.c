/* One-pass CPU kernel for determ's tensor fingerprint and statistics.
 *
 * determ_fp() reads a contiguous buffer once, row by row (a row is ROW_WORDS
 * int32 words, 16 KiB; large buffers are split by rows over OpenMP threads), and
 * returns
 *   - the 64-bit fingerprint defined in determ_backend/fingerprint/core.py (exact
 *     integer arithmetic mod 2**64: bit-identical to the torch and Triton paths);
 *   - optionally [min, max, mean, l2, nan count, inf count, numel] in double.
 *
 * The row sum  sum_c w[c] * K[c]  (mod 2**64) is computed with 32-bit multiplies:
 * K[c] = KH[c] * 2**32 + KL[c] with KL the low word read as signed, so
 *   w * K = w * KL  +  ((w * KH) mod 2**32) * 2**32   (mod 2**64),
 * the first an exact signed 32x32->64 product, the second a 32-bit low product:
 * both are single SIMD instructions on AVX2 (vpmuldq, vpmulld), where a 64-bit
 * multiply is not.  float32 statistics are taken in the same loop, from the same
 * loaded words; other dtypes get a second pass over the row while it is in L1.
 *
 * Built on first use by determ_backend/fingerprint/_native.py with the system C
 * compiler.  Built with DETERM_PYEXT it is also a CPython extension module
 * (determ_fp.fingerprint: one call of a few hundred nanoseconds; with it the
 * loops of the tracing hot path: the user-frame walk, a graph call's trace
 * lines, and the eager modes' per-op recorder in its common case); without
 * Python's headers it is loaded with ctypes; without a compiler determ uses the
 * torch path (and Python for those loops).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROW_WORDS 4096
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define M1 0xFF51AFD7ED558CCDULL
#define M2 0xC4CEB9FE1A85EC53ULL

enum { K_NONE = 0, K_F32, K_F64, K_F16, K_BF16, K_I8, K_U8, K_I16, K_I32, K_I64, K_BOOL, K_U16, K_U32, K_U64 };

static uint64_t fmix(uint64_t v) {
    v ^= v >> 33;
    v *= M1;
    v ^= v >> 33;
    v *= M2;
    v ^= v >> 33;
    return v;
}

/* The row weights, split (see the header comment); set once by determ_fp_init. */
static int32_t KL[ROW_WORDS] __attribute__((aligned(64)));
static uint32_t KH[ROW_WORDS] __attribute__((aligned(64)));
static int weights_ready = 0;

/* k: the ROW_WORDS 64-bit row weights (determ_backend/fingerprint/_words.py). */
void determ_fp_init(const uint64_t *k) {
    for (int c = 0; c < ROW_WORDS; c++) {
        uint32_t lo = (uint32_t)k[c];
        KL[c] = (int32_t)lo;
        KH[c] = (uint32_t)(k[c] >> 32) + (lo >> 31);
    }
    weights_ready = 1;
}

typedef struct { double mn, mx, sum, sq, nan, inf; } stats_t;

static const stats_t STATS_EMPTY = {INFINITY, -INFINITY, 0.0, 0.0, 0.0, 0.0};

/* One value into the statistics; a NaN is left out of min/max (it still makes the sums NaN). */
static void add_value(stats_t *st, double x) {
    if (x == x) {
        if (x < st->mn) st->mn = x;
        if (x > st->mx) st->mx = x;
    }
    st->sum += x;
    st->sq += x * x;
}

/* SIMD: 16 lanes with AVX-512, 8 with AVX2 (the same arithmetic; results are bit-identical
 * between the two for the hash, and equal up to summation order for the sums).  Statistics
 * lanes add BLOCK values and their squares in float32 (at most BLOCK roundings, ~5e-7
 * relative) before each block sum is widened into float64 lane accumulators -- half the work
 * of widening every value, at the float32 data's own precision.  Rows whose magnitudes could
 * overflow or underflow float32 squares are summed again in float64 (fix_f32). */
#define BLOCK 8
#if defined(__AVX512F__)
#define VLANES 16
typedef __m512i vint;
typedef __m512 vflt;
typedef __m512d vdbl;
#define V_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define V_LOADW(p) _mm512_load_si512((const void *)(p))
#define V_LOADF(p) _mm512_loadu_ps(p)
#define V_ADD64 _mm512_add_epi64
#define V_ADD32 _mm512_add_epi32
#define V_SET1_32 _mm512_set1_epi32
#define V_MUL32X64 _mm512_mul_epi32
#define V_MULLO32 _mm512_mullo_epi32
#define V_SRL64 _mm512_srli_epi64
#define V_ZEROI _mm512_setzero_si512
#define V_STOREI(p, v) _mm512_storeu_si512((void *)(p), v)
#define V_CASTF _mm512_castsi512_ps
#define V_MINF _mm512_min_ps
#define V_MAXF _mm512_max_ps
#define V_ADDF _mm512_add_ps
#define V_MULF _mm512_mul_ps
#define V_SET1F _mm512_set1_ps
#define V_ZEROF _mm512_setzero_ps
#define V_STOREF _mm512_storeu_ps
#define V_ADDD _mm512_add_pd
#define V_MULD _mm512_mul_pd
#define V_ZEROD _mm512_setzero_pd
#define V_STORED _mm512_storeu_pd
#define V_LO(f) _mm512_cvtps_pd(_mm512_castps512_ps256(f))
#define V_HI(f) _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)))
#define V_FMAF _mm512_fmadd_ps
#define HAVE_SIMD 1
#elif defined(__AVX2__)
#define VLANES 8
typedef __m256i vint;
typedef __m256 vflt;
typedef __m256d vdbl;
#define V_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_LOADW(p) _mm256_load_si256((const __m256i *)(p))
#define V_LOADF(p) _mm256_loadu_ps(p)
#define V_ADD64 _mm256_add_epi64
#define V_ADD32 _mm256_add_epi32
#define V_SET1_32 _mm256_set1_epi32
#define V_MUL32X64 _mm256_mul_epi32
#define V_MULLO32 _mm256_mullo_epi32
#define V_SRL64 _mm256_srli_epi64
#define V_ZEROI _mm256_setzero_si256
#define V_STOREI(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define V_CASTF _mm256_castsi256_ps
#define V_MINF _mm256_min_ps
#define V_MAXF _mm256_max_ps
#define V_ADDF _mm256_add_ps
#define V_MULF _mm256_mul_ps
#define V_SET1F _mm256_set1_ps
#define V_ZEROF _mm256_setzero_ps
#define V_STOREF _mm256_storeu_ps
#define V_ADDD _mm256_add_pd
#define V_MULD _mm256_mul_pd
#define V_ZEROD _mm256_setzero_pd
#define V_STORED _mm256_storeu_pd
#define V_LO(f) _mm256_cvtps_pd(_mm256_castps256_ps128(f))
#define V_HI(f) _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1))
#if defined(__FMA__)
#define V_FMAF _mm256_fmadd_ps
#endif
#define HAVE_SIMD 1
#endif

#ifdef HAVE_SIMD
typedef struct {
    vflt mn, mx, bs, bq; /* min, max; the current block's sums in float32 */
    vdbl s, q;           /* the blocks' sums in float64 */
    int in_block;
} vstats_t;

static inline void vstats_init(vstats_t *v) {
    v->mn = V_SET1F(INFINITY);
    v->mx = V_SET1F(-INFINITY);
    v->bs = v->bq = V_ZEROF();
    v->s = v->q = V_ZEROD();
    v->in_block = 0;
}

static inline void vstats_flush(vstats_t *v) {
    v->s = V_ADDD(v->s, V_ADDD(V_LO(v->bs), V_HI(v->bs)));
    v->q = V_ADDD(v->q, V_ADDD(V_LO(v->bq), V_HI(v->bq)));
    v->bs = v->bq = V_ZEROF();
    v->in_block = 0;
}

/* min/max leave NaNs out (x86 min/max return the second operand when one is NaN); a NaN or
 * inf makes the sums non-finite, which is when they are counted (fix_f32). */
static inline void vstats_add(vstats_t *v, vflt f) {
    v->mn = V_MINF(f, v->mn);
    v->mx = V_MAXF(f, v->mx);
    v->bs = V_ADDF(v->bs, f);
#ifdef V_FMAF
    v->bq = V_FMAF(f, f, v->bq);
#else
    v->bq = V_ADDF(v->bq, V_MULF(f, f));
#endif
    if (++v->in_block == BLOCK) vstats_flush(v);
}

static inline void vstats_fold(vstats_t *v, stats_t *st) {
    float mn[VLANES], mx[VLANES];
    double s[VLANES / 2], q[VLANES / 2];
    vstats_flush(v);
    V_STOREF(mn, v->mn);
    V_STOREF(mx, v->mx);
    V_STORED(s, v->s);
    V_STORED(q, v->q);
    for (int j = 0; j < VLANES; j++) {
        if ((double)mn[j] < st->mn) st->mn = mn[j];
        if ((double)mx[j] > st->mx) st->mx = mx[j];
    }
    for (int j = 0; j < VLANES / 2; j++) {
        st->sum += s[j];
        st->sq += q[j];
    }
}
#endif

/* The float64 sums of n float32 values. */
static void f32_sums_f64(const float *f, int64_t n, double *sum, double *sq) {
    double s = 0.0, q = 0.0;
    int64_t i = 0;
#ifdef HAVE_SIMD
    vdbl vs = V_ZEROD(), vq = V_ZEROD();
    for (; i + VLANES <= n; i += VLANES) {
        vflt x = V_LOADF(f + i);
        vdbl d0 = V_LO(x), d1 = V_HI(x);
        vs = V_ADDD(vs, V_ADDD(d0, d1));
        vq = V_ADDD(vq, V_ADDD(V_MULD(d0, d0), V_MULD(d1, d1)));
    }
    double a[VLANES / 2], b[VLANES / 2];
    V_STORED(a, vs);
    V_STORED(b, vq);
    for (int j = 0; j < VLANES / 2; j++) {
        s += a[j];
        q += b[j];
    }
#endif
    for (; i < n; i++) {
        s += (double)f[i];
        q += (double)f[i] * (double)f[i];
    }
    *sum = s;
    *sq = q;
}

/* After the float32-block sums of n float32 values (st: theirs alone): where they are not finite,
 * NaN and inf are counted; where float32 blocks may have overflowed or lost squares to underflow
 * (largest magnitude over 1e19, or under 1e-12 and not 0), the sums are redone in float64. */
static void fix_f32(const float *f, int64_t n, stats_t *st) {
    double big = fabs(st->mn) > fabs(st->mx) ? fabs(st->mn) : fabs(st->mx);
    int finite = isfinite(st->sum) && isfinite(st->sq);
    if (finite && big <= 1e19 && (big >= 1e-12 || big == 0.0)) return;
    if (!finite) {
        const uint32_t *u = (const uint32_t *)f;
        double nan = 0, inf = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t mag = u[i] & 0x7fffffffu;
            nan += mag > 0x7f800000u;
            inf += mag == 0x7f800000u;
        }
        st->nan += nan;
        st->inf += inf;
        if (nan > 0 || inf > 0) return; /* the sums are NaN or infinite, as they should be */
    }
    f32_sums_f64(f, n, &st->sum, &st->sq);
}

/* The row sum of n words (n <= ROW_WORDS, column 0 first); with f32 != 0 also the float32
 * statistics of the same words into *st (NaN/inf counts excepted: see fix_f32). */
static inline __attribute__((always_inline)) uint64_t row_pass(const int32_t *w, int64_t n, int f32, stats_t *st) {
    uint64_t a = 0;
    uint32_t b = 0;
    int64_t c = 0;
#ifdef HAVE_SIMD
    vint ae = V_ZEROI(), ao = V_ZEROI(), bb = V_ZEROI();
    vstats_t vs;
    if (f32) vstats_init(&vs);
    /* KL[c] is the low word of (2c+1) * M1: one lane-wise add steps it VLANES columns on, where a load
     * would double the weights read per data byte (the loads, not the arithmetic, bound the loop once the
     * data comes from memory) */
    vint L = V_LOADW(KL), LSTEP = V_SET1_32((int32_t)(uint32_t)(2u * VLANES * (uint32_t)M1));
    for (; c + VLANES <= n; c += VLANES, L = V_ADD32(L, LSTEP)) {
        vint W = V_LOADI(w + c), H = V_LOADW(KH + c);
        ae = V_ADD64(ae, V_MUL32X64(W, L));                           /* even words */
        ao = V_ADD64(ao, V_MUL32X64(V_SRL64(W, 32), V_SRL64(L, 32))); /* odd words */
        bb = V_ADD32(bb, V_MULLO32(W, H));
        if (f32) vstats_add(&vs, V_CASTF(W));
    }
    uint64_t e[VLANES / 2], o[VLANES / 2];
    uint32_t h[VLANES];
    V_STOREI(e, ae);
    V_STOREI(o, ao);
    V_STOREI(h, bb);
    for (int j = 0; j < VLANES / 2; j++) a += e[j] + o[j];
    for (int j = 0; j < VLANES; j++) b += h[j];
    if (f32) vstats_fold(&vs, st);
#endif
    for (; c < n; c++) {
        a += (uint64_t)((int64_t)w[c] * KL[c]);
        b += (uint32_t)w[c] * KH[c];
        if (f32) {
            float x;
            memcpy(&x, w + c, 4);
            add_value(st, x);
        }
    }
    return a + ((uint64_t)b << 32);
}

/* Statistics of n float32 values (the 16-bit float kinds, widened exactly); st: theirs alone. */
static void f32_stats(const float *f, int64_t n, stats_t *st) {
    int64_t i = 0;
#ifdef HAVE_SIMD
    vstats_t vs;
    vstats_init(&vs);
    for (; i + VLANES <= n; i += VLANES) vstats_add(&vs, V_LOADF(f + i));
    vstats_fold(&vs, st);
#endif
    for (; i < n; i++) add_value(st, f[i]);
    fix_f32(f, n, st);
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define CHUNK 1024

/* 16-bit floats: widened to float32 a chunk at a time (exact: every half and bfloat16 value is a
 * float32 value), then float32 statistics; each chunk's sums are checked for NaN/inf on their own. */
#define HALF_STATS(CONV)                                             \
    {                                                                \
        const uint16_t *hp = (const uint16_t *)p;                    \
        float buf[CHUNK];                                            \
        for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {                  \
            int64_t m = n - c0 < CHUNK ? n - c0 : CHUNK;             \
            stats_t part = STATS_EMPTY;                              \
            for (int64_t i = 0; i < m; i++) buf[i] = CONV(hp[c0 + i]); \
            f32_stats(buf, m, &part);                                \
            merge_stats(st, &part);                                  \
        }                                                            \
    }

static void merge_stats(stats_t *st, const stats_t *part) {
    if (part->mn < st->mn) st->mn = part->mn;
    if (part->mx > st->mx) st->mx = part->mx;
    st->sum += part->sum;
    st->sq += part->sq;
    st->nan += part->nan;
    st->inf += part->inf;
}

static void f64_stats(const double *d, int64_t n, stats_t *st) {
    int64_t i = 0;
#if defined(__AVX2__)
    __m256d mn = _mm256_set1_pd(INFINITY), mx = _mm256_set1_pd(-INFINITY), s = _mm256_setzero_pd(),
            q = _mm256_setzero_pd();
    for (; i + 4 <= n; i += 4) {
        __m256d x = _mm256_loadu_pd(d + i);
        mn = _mm256_min_pd(x, mn);
        mx = _mm256_max_pd(x, mx);
        s = _mm256_add_pd(s, x);
        q = _mm256_add_pd(q, _mm256_mul_pd(x, x));
    }
    double a[4], b[4], c[4], e[4];
    _mm256_storeu_pd(a, mn);
    _mm256_storeu_pd(b, mx);
    _mm256_storeu_pd(c, s);
    _mm256_storeu_pd(e, q);
    for (int j = 0; j < 4; j++) {
        if (a[j] < st->mn) st->mn = a[j];
        if (b[j] > st->mx) st->mx = b[j];
        st->sum += c[j];
        st->sq += e[j];
    }
#endif
    for (; i < n; i++) add_value(st, d[i]);
    if (!(isfinite(st->sum) && isfinite(st->sq))) {
        for (int64_t j = 0; j < n; j++) {
            if (d[j] != d[j]) st->nan += 1;
            else if (isinf(d[j])) st->inf += 1;
        }
    }
}

#define INT_STATS(T)                                                 \
    for (int64_t i = 0; i < n; i++) add_value(st, (double)((const T *)p)[i]);

/* Statistics of n elements of a kind other than float32 (float32 is done in row_pass). */
static void elem_stats(const void *p, int64_t n, int kind, stats_t *st) {
    switch (kind) {
    case K_F64: f64_stats((const double *)p, n, st); break;
    case K_F16: HALF_STATS(half_to_float) break;
    case K_BF16: HALF_STATS(bf16_to_float) break;
    case K_I8: INT_STATS(int8_t) break;
    case K_U8: INT_STATS(uint8_t) break;
    case K_BOOL: INT_STATS(uint8_t) break;
    case K_I16: INT_STATS(int16_t) break;
    case K_U16: INT_STATS(uint16_t) break;
    case K_I32: INT_STATS(int32_t) break;
    case K_U32: INT_STATS(uint32_t) break;
    case K_I64: INT_STATS(int64_t) break;
    case K_U64: INT_STATS(uint64_t) break;
    default: break;
    }
}

typedef struct {
    const unsigned char *bytes;
    int64_t nbytes, nwords, full_words, elem;
    int kind, do_stats;
} buf_t;

/* Row r's mixed row sum; its statistics go to *rs when statistics are asked for. */
static uint64_t run_row(const buf_t *b, int64_t r, stats_t *rs) {
    int32_t tmp[ROW_WORDS];
    int64_t w0 = r * ROW_WORDS;
    int64_t nw = b->nwords - w0 < ROW_WORDS ? b->nwords - w0 : ROW_WORDS;
    const int32_t *w;
    if (((uintptr_t)(b->bytes + 4 * w0) & 3) == 0 && (w0 + nw <= b->full_words)) {
        w = (const int32_t *)(b->bytes + 4 * w0);
    } else { /* misaligned data or the zero-padded last word */
        int64_t nb = (w0 + nw <= b->full_words) ? 4 * nw : b->nbytes - 4 * w0;
        memset(tmp, 0, sizeof(int32_t) * (size_t)nw);
        memcpy(tmp, b->bytes + 4 * w0, (size_t)nb);
        w = tmp;
    }
    uint64_t s;
    if (b->do_stats) {
        *rs = STATS_EMPTY;
        if (b->kind == K_F32) { /* whole float32 elements: nbytes is a multiple of 4 */
            s = row_pass(w, nw, 1, rs);
            fix_f32((const float *)w, nw, rs);
        } else {
            /* the row's elements (a 16 KiB row holds whole elements of every supported kind) */
            int64_t b0 = 4 * w0, b1 = 4 * (w0 + nw) < b->nbytes ? 4 * (w0 + nw) : b->nbytes;
            s = row_pass(w, nw, 0, NULL);
            elem_stats(b->bytes + b0, (b1 - b0) / b->elem, b->kind, rs);
        }
    } else {
        s = row_pass(w, nw, 0, NULL);
    }
    return fmix(s ^ fmix((uint64_t)(r + 1) * GOLDEN));
}

#define ROWS_PER_THREAD 64 /* 1 MiB: below that a thread costs more than it saves */
#define STACK_ROWS 64

/* Fingerprint (and statistics) of nbytes of contiguous data holding numel elements of
 * the given kind.  key: the dtype/shape key.  stats_out (when not NULL): the statistics as
 * determ_backend.fingerprint.core reports them, [min, max, mean, l2, nan count, inf count,
 * numel] -- min/max (and l2) NaN when a NaN is present, an empty tensor [nan, nan, nan, 0, 0,
 * 0, 0].  Large buffers are split by rows over up to
 * nthreads OpenMP threads (torch's own pool when torch's libgomp is the one loaded);
 * results do not depend on the split: row sums combine exactly, statistics are kept per
 * row and combined in row order.  Returns 0; -1 when scratch memory cannot be allocated;
 * -2 when determ_fp_init was not called. */
int determ_fp(const void *data, int64_t nbytes, int kind, int64_t numel, uint64_t key, int nthreads,
              uint64_t *hash_out, double *stats_out) {
    if (!weights_ready) return -2;
    buf_t b;
    b.bytes = (const unsigned char *)data;
    b.nbytes = nbytes;
    b.elem = numel > 0 ? nbytes / numel : 0;
    b.full_words = nbytes / 4;
    b.nwords = b.full_words + (nbytes % 4 ? 1 : 0);
    b.kind = kind;
    b.do_stats = stats_out != NULL && kind != K_NONE && b.elem > 0;
    int64_t rows = (b.nwords + ROW_WORDS - 1) / ROW_WORDS;
    stats_t on_stack[STACK_ROWS];
    stats_t *row_stats = on_stack;
    if (b.do_stats && rows > STACK_ROWS) {
        row_stats = (stats_t *)malloc(sizeof(stats_t) * (size_t)rows);
        if (!row_stats) return -1;
    }
    int64_t most = rows / ROWS_PER_THREAD;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (most < nt) nt = most < 1 ? 1 : (int)most;
    uint64_t acc = 0;
    if (nt > 1) {
#pragma omp parallel for num_threads(nt) reduction(+ : acc) schedule(static)
        for (int64_t r = 0; r < rows; r++) acc += run_row(&b, r, b.do_stats ? &row_stats[r] : NULL);
    } else {
        for (int64_t r = 0; r < rows; r++) acc += run_row(&b, r, b.do_stats ? &row_stats[r] : NULL);
    }
    *hash_out = fmix(acc ^ key);
    if (stats_out) {
        stats_t st = STATS_EMPTY;
        for (int64_t r = 0; b.do_stats && r < rows; r++) merge_stats(&st, &row_stats[r]);
        if (st.nan > 0) { st.mn = NAN; st.mx = NAN; }
        if (numel == 0) {
            stats_out[0] = stats_out[1] = stats_out[2] = NAN;
            stats_out[3] = stats_out[4] = stats_out[5] = stats_out[6] = 0.0;
        } else {
            stats_out[0] = st.mn;
            stats_out[1] = st.mx;
            stats_out[2] = st.sum / (double)numel;
            stats_out[3] = st.nan > 0 ? NAN : sqrt(st.sq);
            stats_out[4] = st.nan;
            stats_out[5] = st.inf;
            stats_out[6] = (double)numel;
        }
    }
    if (row_stats != on_stack) free(row_stats);
    return 0;
}

#ifdef DETERM_PYEXT
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#define RELEASE_GIL_BYTES (256 * 1024) /* below that, releasing and taking back the GIL costs more */

/* determ_fp called from Python: without the GIL for a buffer large enough that taking it back costs less */
static int fingerprint_holding(unsigned long long ptr, long long nbytes, int kind, long long numel, unsigned long long key,
                               int nthreads, uint64_t *h, double *v) {
    const void *data = (const void *)(uintptr_t)ptr;
    int rc;
    if (nbytes >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        rc = determ_fp(data, nbytes, kind, numel, key, nthreads, h, v);
        Py_END_ALLOW_THREADS
    } else {
        rc = determ_fp(data, nbytes, kind, numel, key, nthreads, h, v);
    }
    return rc;
}

/* fingerprint(data_ptr, nbytes, kind, numel, key, nthreads, stats) ->
 *   (hash, None) | (hash, (min, max, mean, l2, nan, inf, numel)) | None (scratch memory)
 * The statistics are determ_fp's stats_out. */
static PyObject *py_fingerprint(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "fingerprint() takes 7 arguments");
        return NULL;
    }
    unsigned long long ptr = PyLong_AsUnsignedLongLongMask(args[0]);
    long long nbytes = PyLong_AsLongLong(args[1]);
    long kind = PyLong_AsLong(args[2]);
    long long numel = PyLong_AsLongLong(args[3]);
    unsigned long long key = PyLong_AsUnsignedLongLongMask(args[4]);
    long nthreads = PyLong_AsLong(args[5]);
    int want = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (nbytes < 0 || numel < 0) {
        PyErr_SetString(PyExc_ValueError, "fingerprint(): negative size");
        return NULL;
    }
    uint64_t h = 0;
    double v[7];
    int rc = fingerprint_holding(ptr, nbytes, (int)kind, numel, key, (int)nthreads, &h, want ? v : NULL);
    if (rc == -2) {
        PyErr_SetString(PyExc_RuntimeError, "fingerprint(): init() was not called");
        return NULL;
    }
    if (rc != 0) Py_RETURN_NONE;
    if (!want) return Py_BuildValue("(KO)", (unsigned long long)h, Py_None);
    return Py_BuildValue("(K(ddddddd))", (unsigned long long)h, v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
}

/* init(weights_ptr): the ROW_WORDS uint64 row weights, read once. */
static PyObject *py_init(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long ptr = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    determ_fp_init((const uint64_t *)(uintptr_t)ptr);
    Py_RETURN_NONE;
}

/* first_listed_not(frame, internal) -> frame | None
 * From frame outwards, the first frame whose code object's id() internal does not map to True: a
 * user frame (mapped to False) or one not classified yet (absent), which the caller classifies.
 * Keyed by id because hashing a code object hashes its bytecode and constants each time.  The walk
 * behind every user source line (determ_backend/_frames.py), one C loop instead of a Python loop
 * per frame. */
static PyObject *py_first_listed_not(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "first_listed_not(frame, dict)");
        return NULL;
    }
    PyObject *internal = args[1];
    if (args[0] == Py_None) Py_RETURN_NONE;
    if (!PyFrame_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "first_listed_not: expected a frame");
        return NULL;
    }
    PyFrameObject *f = (PyFrameObject *)args[0];
    Py_INCREF(f);
    while (f != NULL) {
        PyCodeObject *code = PyFrame_GetCode(f);
        PyObject *key = PyLong_FromVoidPtr(code);
        Py_DECREF(code);
        if (key == NULL) {
            Py_DECREF(f);
            return NULL;
        }
        PyObject *v = PyDict_GetItemWithError(internal, key);
        Py_DECREF(key);
        if (v != Py_True) {
            if (v == NULL && PyErr_Occurred()) {
                Py_DECREF(f);
                return NULL;
            }
            return (PyObject *)f;
        }
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_RETURN_NONE;
}

/* ---- trace lines ------------------------------------------------------------------------------
 * trace_lines(call, rows, dumps) -> [bytes]: the JSON Lines text of a graph call's records, one line (no
 * newline) per row, byte for byte what RecordTemplate.line (determ_backend/trace/stream.py) gives.  A row
 * is (template, dtype str | None, shape list | None, hash int | None, stats dict | None); the template's
 * _frags is (head, source, mid, extra): its fixed fragments, bytes or None.  The statistics are written by
 * dumps (orjson's, as the trace encoder does).  A row holding anything this encoder does not write the
 * way the trace encoder would (a string that needs escaping, statistics orjson writes with a null...) is
 * encoded by template.line(...) instead. */

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} sbuf;

static int sb_grow(sbuf *b, Py_ssize_t more) {
    if (b->n + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 512;
    while (cap < b->n + more) cap *= 2;
    char *q = (char *)PyMem_Realloc(b->p, (size_t)cap);
    if (!q) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = q;
    b->cap = cap;
    return 0;
}

static int sb_put(sbuf *b, const char *s, Py_ssize_t n) {
    if (sb_grow(b, n) < 0) return -1;
    memcpy(b->p + b->n, s, (size_t)n);
    b->n += n;
    return 0;
}

static int sb_str(sbuf *b, const char *s) { return sb_put(b, s, (Py_ssize_t)strlen(s)); }

static int sb_bytes(sbuf *b, PyObject *o) { /* o: bytes */
    return sb_put(b, PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
}

/* A JSON string of plain printable ASCII; 1 when the text needs escaping (the caller falls back). */
static int sb_plain_string(sbuf *b, PyObject *u) {
    if (!PyUnicode_Check(u) || !PyUnicode_IS_ASCII(u)) return 1;
    const char *s = (const char *)PyUnicode_DATA(u);
    Py_ssize_t n = PyUnicode_GET_LENGTH(u);
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] == '"' || s[i] == '\\' || s[i] == 0x7f) return 1;
    if (sb_grow(b, n + 2) < 0) return -1;
    b->p[b->n++] = '"';
    memcpy(b->p + b->n, s, (size_t)n);
    b->n += n;
    b->p[b->n++] = '"';
    return 0;
}

/* Whether the text holds "null" (orjson's NaN, infinity or None: the standard library writes those). */
static int has_null(const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i + 4 <= n; i++)
        if (s[i] == 'n' && memcmp(s + i, "null", 4) == 0) return 1;
    return 0;
}

/* One row into b (emptied first); 1 when the row must be encoded by the template instead.  dumps: orjson's
 * dumps, which writes the statistics (a line where it writes null or raises is the template's). */
static int encode_row(sbuf *b, long long call, Py_ssize_t seq, PyObject *row, PyObject *frags_name, PyObject *dumps) {
    b->n = 0;
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 5) return 1;
    PyObject *frags = PyObject_GetAttr(PyTuple_GET_ITEM(row, 0), frags_name);
    if (!frags) return -1;
    int rc = 1;
    if (!PyTuple_Check(frags) || PyTuple_GET_SIZE(frags) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(frags, 0))) goto done;
    PyObject *dtype = PyTuple_GET_ITEM(row, 1), *shape = PyTuple_GET_ITEM(row, 2);
    PyObject *hash = PyTuple_GET_ITEM(row, 3), *stats = PyTuple_GET_ITEM(row, 4);
    char t[64];
    if ((rc = sb_bytes(b, PyTuple_GET_ITEM(frags, 0))) != 0) goto done;
    if ((rc = sb_put(b, t, snprintf(t, sizeof t, ",\"call\":%lld,\"seq\":%zd", call, seq))) != 0) goto done;
    PyObject *source = PyTuple_GET_ITEM(frags, 1);
    if (source != Py_None) {
        rc = 1;
        if (!PyBytes_Check(source)) goto done;
        if ((rc = sb_put(b, ",", 1)) != 0 || (rc = sb_bytes(b, source)) != 0) goto done;
    }
    if (dtype != Py_None) {
        if ((rc = sb_str(b, ",\"dtype\":")) != 0 || (rc = sb_plain_string(b, dtype)) != 0) goto done;
    }
    if (shape != Py_None) {
        rc = 1;
        if (!PyList_Check(shape)) goto done;
        if ((rc = sb_str(b, ",\"shape\":[")) != 0) goto done;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(shape); i++) {
            PyObject *v = PyList_GET_ITEM(shape, i);
            rc = 1;
            if (!PyLong_CheckExact(v)) goto done;
            int overflow = 0;
            long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow) goto done;
            if (n == -1 && PyErr_Occurred()) {
                rc = -1;
                goto done;
            }
            if ((rc = sb_put(b, t, snprintf(t, sizeof t, i ? ",%lld" : "%lld", n))) != 0) goto done;
        }
        if ((rc = sb_put(b, "]", 1)) != 0) goto done;
    }
    if (hash != Py_None) {
        rc = 1;
        if (!PyLong_Check(hash)) goto done;
        unsigned long long h = PyLong_AsUnsignedLongLongMask(hash);
        if (h == (unsigned long long)-1 && PyErr_Occurred()) {
            rc = -1;
            goto done;
        }
        if ((rc = sb_put(b, t, snprintf(t, sizeof t, ",\"hash\":\"%016llx\"", h))) != 0) goto done;
    }
    if (stats != Py_None) {
        rc = 1;
        if (!PyDict_Check(stats)) goto done;
        if (PyDict_GET_SIZE(stats) > 0) {
            PyObject *enc = PyObject_CallOneArg(dumps, stats);
            if (!enc) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                    rc = -1;
                    goto done;
                }
                PyErr_Clear(); /* a value orjson does not write */
                goto done;
            }
            int ok = PyBytes_Check(enc) && !has_null(PyBytes_AS_STRING(enc), PyBytes_GET_SIZE(enc));
            if (ok) rc = sb_str(b, ",\"stats\":");
            if (ok && rc == 0) rc = sb_bytes(b, enc);
            Py_DECREF(enc);
            if (!ok || rc != 0) goto done;
        }
    }
    for (int j = 2; j < 4; j++) {
        PyObject *f = PyTuple_GET_ITEM(frags, j);
        if (f == Py_None) continue;
        rc = 1;
        if (!PyBytes_Check(f)) goto done;
        if ((rc = sb_put(b, ",", 1)) != 0 || (rc = sb_bytes(b, f)) != 0) goto done;
    }
    rc = sb_put(b, "}", 1);
done:
    Py_DECREF(frags);
    return rc;
}

static PyObject *py_trace_lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 || !PyList_Check(args[1]) || !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "trace_lines(call, rows: list, dumps)");
        return NULL;
    }
    long long call = PyLong_AsLongLong(args[0]);
    if (call == -1 && PyErr_Occurred()) return NULL;
    static PyObject *frags_name = NULL, *line_name = NULL;
    if (!frags_name && !(frags_name = PyUnicode_InternFromString("_frags"))) return NULL;
    if (!line_name && !(line_name = PyUnicode_InternFromString("line"))) return NULL;
    PyObject *rows = args[1];
    Py_ssize_t n = PyList_GET_SIZE(rows);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    sbuf b = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        int rc = encode_row(&b, call, i, row, frags_name, args[2]);
        PyObject *line;
        if (rc < 0) goto fail;
        if (rc == 0) {
            line = PyBytes_FromStringAndSize(b.p, b.n);
        } else { /* template.line(call, seq, dtype, shape, hash, stats) */
            if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 5) {
                PyErr_SetString(PyExc_TypeError, "trace_lines: a row is (template, dtype, shape, hash, stats)");
                goto fail;
            }
            PyObject *seq = PyLong_FromSsize_t(i);
            if (!seq) goto fail;
            line = PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(row, 0), line_name, args[0], seq,
                                              PyTuple_GET_ITEM(row, 1), PyTuple_GET_ITEM(row, 2),
                                              PyTuple_GET_ITEM(row, 3), PyTuple_GET_ITEM(row, 4), NULL);
            Py_DECREF(seq);
        }
        if (!line) goto fail;
        PyList_SET_ITEM(out, i, line);
    }
    PyMem_Free(b.p);
    return out;
fail:
    PyMem_Free(b.p);
    Py_DECREF(out);
    return NULL;
}

#if PY_VERSION_HEX >= 0x030B0000 /* Python 3.11 and later: older ones record in Python */
/* ---- the eager modes' per-op recorder, its common case ------------------------------------------
 * op_begin(recorder, func, args, kwargs, frame, compiled) -> context
 * op_end(recorder, context, result, args, kwargs, nondeterministic) -> [Record]
 * OpRecorder.begin and OpRecorder.end (determ_backend/modes/_record.py) for an op whose every step is the
 * common one, with the same tables, the same records and the same names; every branch they take for anything
 * else (a first-seen input, an input found by its memory, a view's or a copy's fingerprint, a collective, an
 * out= argument, the text log's argument descriptions, a flush...) calls the Python method that does it, and
 * an op that needs more than that is handed to OpRecorder.begin / OpRecorder.end whole, before anything
 * changed.  setup_recorder(names) gives the module the Python objects it works with, once. */

static PyObject *RS = NULL; /* the setup dict: keeps every object below alive */
static PyObject *R_Tensor, *R_Parameter, *R_Size, *R_Record, *R_OpEvent, *R_strided, *R_fwd_key, *R_infos, *R_op_info,
    *R_lines, *R_frames, *R_frames_cache, *R_engine, *R_dtype_names, *R_dtype_name, *R_node_getter, *R_grad_enabled,
    *R_written_tensors, *R_supported, *R_key, *R_is_zero, *R_stats_dict, *R_host_batch, *R_flush_bytes, *R_weak_storage,
    *R_storage_expired, *R_storage_release, *R_uninitialized_hash;
static PyObject *S_eager, *S_node_kind, *S_bw, *S_unknown, *S_stack, *S_backward, *S_compiled_region, *S_empty_str,
    *S_empty_tuple, *S_zero, *S_one, *S_derived_hash;

#define NAMES(X)                                                                                                   \
    X(_unsettled) X(_settle) X(_by_object) X(_producer_by_memory) X(_input_record) X(_tag_grad_fn) X(_where)      \
    X(begin) X(end) X(describe_args) X(stack_depth) X(_silent) X(_version) X(requires_grad) X(grad_fn)          \
    X(metadata) X(name) X(_counts) X(seq) X(rank) X(run) X(_capture) X(_hash_output) X(_hashes) X(_items)        \
    X(nbytes) X(_batch) X(_looked_up) X(_kernel) X(_want) X(_max_first) X(_out) X(threads) X(dtype) X(shape)    \
    X(is_nested) X(layout) X(is_meta) X(is_cpu) X(is_quantized) X(is_conj) X(is_neg) X(numel) X(is_contiguous) \
    X(data_ptr) X(_base) X(_written_through_view) X(compiled_ops) X(_events) X(batch) X(flush) X(on_host)        \
    X(internal) X(node) X(_flush_due) X(stats) X(_producers) X(set_producer) X(stride) X(device) X(get) X(storage_offset) X(element_size) X(extra) X(hash)
#define DECLARE(n) static PyObject *N_##n;
NAMES(DECLARE)
#undef DECLARE

static int intern_names(void) {
#define INTERN(n) if (!(N_##n = PyUnicode_InternFromString(#n))) return -1;
    NAMES(INTERN)
#undef INTERN
    return 0;
}

static PyObject *setup_item(PyObject *d, const char *k) {
    PyObject *v = PyDict_GetItemString(d, k);
    if (!v) PyErr_Format(PyExc_KeyError, "setup_recorder: %s missing", k);
    return v;
}

/* setup_recorder(names: dict) */
static PyObject *py_setup_recorder(PyObject *self, PyObject *d) {
    (void)self;
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "setup_recorder(dict)");
        return NULL;
    }
    if (!N__unsettled && intern_names() < 0) return NULL;
#define ITEM(var, key) if (!(var = setup_item(d, key))) return NULL;
    ITEM(R_Tensor, "Tensor") ITEM(R_Parameter, "Parameter") ITEM(R_Size, "Size") ITEM(R_Record, "Record")
    ITEM(R_OpEvent, "OpEvent") ITEM(R_strided, "strided") ITEM(R_fwd_key, "FORWARD_KEY") ITEM(R_infos, "OP_INFO")
    ITEM(R_op_info, "op_info") ITEM(R_lines, "LINES") ITEM(R_frames, "FRAMES") ITEM(R_frames_cache, "FRAMES_CACHE")
    ITEM(R_engine, "engine") ITEM(R_dtype_names, "DTYPE_NAMES") ITEM(R_dtype_name, "dtype_name")
    ITEM(R_node_getter, "autograd_node") ITEM(R_grad_enabled, "is_grad_enabled")
    ITEM(R_written_tensors, "written_tensors") ITEM(R_supported, "SUPPORTED") ITEM(R_key, "key")
    ITEM(R_is_zero, "is_zero_tensor") ITEM(R_stats_dict, "stats_dict") ITEM(R_host_batch, "HOST_BATCH")
    ITEM(R_flush_bytes, "FLUSH_BYTES") ITEM(R_weak_storage, "storage_weak_ref") ITEM(R_storage_expired, "storage_expired")
    ITEM(R_storage_release, "storage_release") ITEM(R_uninitialized_hash, "uninitialized_hash")
#undef ITEM
    if (!S_eager) {
        if (!(S_eager = PyUnicode_InternFromString("eager")) || !(S_node_kind = PyUnicode_InternFromString("node")) ||
            !(S_bw = PyUnicode_InternFromString("/bw")) || !(S_unknown = PyUnicode_InternFromString("?")) ||
            !(S_stack = PyUnicode_InternFromString("stack")) ||
            !(S_backward = PyUnicode_InternFromString("backward")) ||
            !(S_compiled_region = PyUnicode_InternFromString("compiled_region")) ||
            !(S_empty_str = PyUnicode_FromString("")) || !(S_empty_tuple = PyTuple_New(0)) ||
            !(S_zero = PyLong_FromLong(0)) || !(S_one = PyLong_FromLong(1)) ||
            !(S_derived_hash = PyUnicode_InternFromString("derived_hash")))
            return NULL;
    }
    Py_INCREF(d);
    PyObject *old = RS;
    RS = d;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* 1 when code is not the user's (FrameFilter.internal, its cache read here), 0 when it is, -1 on error */
static int code_internal(PyCodeObject *code) {
    PyObject *k = PyLong_FromVoidPtr(code);
    if (!k) return -1;
    PyObject *v = PyDict_GetItemWithError(R_frames_cache, k);
    Py_DECREF(k);
    if (v) return v == Py_True;
    if (PyErr_Occurred()) return -1;
    PyObject *r = PyObject_CallMethodOneArg(R_frames, N_internal, (PyObject *)code);
    if (!r) return -1;
    int out = PyObject_IsTrue(r);
    Py_DECREF(r);
    return out;
}

/* From frame outwards, the first user frame (a new reference in *found, its code in *code), or none (NULL) when
 * there is none or the walk reaches the code object stop first; 0, or -1 on error */
static int first_user_frame(PyObject *frame, PyObject *stop, PyFrameObject **found, PyCodeObject **code) {
    PyFrameObject *f = frame == Py_None ? NULL : (PyFrameObject *)frame;
    Py_XINCREF(f);
    *found = NULL;
    *code = NULL;
    while (f) {
        PyCodeObject *c = PyFrame_GetCode(f);
        int internal = (PyObject *)c == stop ? 2 : code_internal(c);
        if (internal != 1) {
            if (internal == 0) {
                *found = f;
                *code = c;
                return 0;
            }
            Py_DECREF(c);
            Py_DECREF(f);
            return internal < 0 ? -1 : 0;
        }
        Py_DECREF(c);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    return 0;
}

/* OpRecorder._run_by_user: 1, 0, or -1 on error */
static int run_by_user(PyObject *frame) {
    PyFrameObject *f;
    PyCodeObject *code;
    if (first_user_frame(frame, R_engine, &f, &code) < 0) return -1;
    Py_XDECREF(f);
    Py_XDECREF(code);
    return f != NULL;
}

/* "file:line in function" of one frame, as OpRecorder._where writes a stack's entries: a new reference */
static PyObject *stack_entry(PyFrameObject *f) {
    PyCodeObject *code = PyFrame_GetCode(f);
    PyObject *e = PyUnicode_FromFormat("%U:%d in %U", code->co_filename, PyFrame_GetLineNumber(f), code->co_name);
    Py_DECREF(code);
    return e;
}

/* OpRecorder._where: (source, location) and, when stack is not NULL, the first depth user frames' entries (None when
 * there is no user frame), as new references; 0, or -1 on error.  A line not in LINES yet is entered there by the
 * Python method, which then gives the whole answer. */
static int where(PyObject *rec, PyObject *frame, long depth, PyObject **source, PyObject **loc, PyObject **stack) {
    PyFrameObject *f;
    PyCodeObject *code;
    if (first_user_frame(frame, NULL, &f, &code) < 0) return -1;
    if (!f) {
        *source = Py_NewRef(Py_None);
        *loc = Py_NewRef(S_unknown);
        if (stack) *stack = Py_NewRef(Py_None);
        return 0;
    }
    PyObject *key = Py_BuildValue("(Ni)", PyLong_FromVoidPtr(code), PyFrame_GetLineNumber(f));
    PyObject *w = key ? PyDict_GetItemWithError(R_lines, key) : NULL;
    Py_XDECREF(key);
    int known = w && PyTuple_Check(w) && PyTuple_GET_SIZE(w) == 3 && PyTuple_GET_ITEM(w, 2) == (PyObject *)code;
    Py_DECREF(code); /* only compared by identity: the frame f keeps it alive */
    if (!known) {
        Py_DECREF(f);
        if (PyErr_Occurred()) return -1;
        PyObject *r = PyObject_CallMethodOneArg(rec, N__where, frame); /* enters the line */
        if (!r) return -1;
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_TypeError, "OpRecorder._where: expected (source, location, stack)");
            return -1;
        }
        *source = Py_NewRef(PyTuple_GET_ITEM(r, 0));
        *loc = Py_NewRef(PyTuple_GET_ITEM(r, 1));
        if (stack) *stack = Py_NewRef(PyTuple_GET_ITEM(r, 2));
        Py_DECREF(r);
        return 0;
    }
    *source = Py_NewRef(PyTuple_GET_ITEM(w, 0));
    *loc = Py_NewRef(PyTuple_GET_ITEM(w, 1));
    if (!stack) {
        Py_DECREF(f);
        return 0;
    }
    /* user_frames(frame, depth): at least the first one */
    PyObject *entries = PyList_New(0);
    while (entries && f) {
        PyObject *e = stack_entry(f);
        if (!e || PyList_Append(entries, e) < 0) {
            Py_XDECREF(e);
            Py_CLEAR(entries);
            break;
        }
        Py_DECREF(e);
        if (PyList_GET_SIZE(entries) >= depth) break;
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = NULL;
        if (!back) break;
        int r = first_user_frame((PyObject *)back, NULL, &f, &code);
        Py_DECREF(back);
        Py_XDECREF(code);
        if (r < 0) Py_CLEAR(entries);
    }
    Py_XDECREF(f); /* left by a full list, or by an error making an entry */
    if (!entries) {
        Py_CLEAR(*source);
        Py_CLEAR(*loc);
        return -1;
    }
    *stack = entries;
    return 0;
}

/* tensor_args (determ_backend/modes/ops.py) of one argument, appended to out */
static int collect_tensors(PyObject *a, PyObject *out) {
    if (PyLong_CheckExact(a) || PyFloat_CheckExact(a) || a == Py_None || PyBool_Check(a)) return 0;
    int is = PyObject_IsInstance(a, R_Tensor);
    if (is < 0) return -1;
    if (is) return PyList_Append(out, a);
    if ((PyList_Check(a) || PyTuple_Check(a)) && PySequence_Size(a) > 0) {
        int size = PyObject_IsInstance(a, R_Size);
        if (size < 0) return -1;
        if (size) return 0;
        PyObject *seq = PySequence_Fast(a, "");
        if (!seq) return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (collect_tensors(PySequence_Fast_GET_ITEM(seq, i), out) < 0) {
                Py_DECREF(seq);
                return -1;
            }
        }
        Py_DECREF(seq);
    }
    return 0;
}

/* the op's facts (determ_backend.modes._record.op_info), a new reference */
static PyObject *op_facts(PyObject *func) {
    PyObject *k = PyLong_FromVoidPtr(func);
    if (!k) return NULL;
    PyObject *info = PyDict_GetItemWithError(R_infos, k);
    Py_DECREF(k);
    if (info && PyTuple_Check(info) && PyTuple_GET_SIZE(info) >= 9 && PyTuple_GET_ITEM(info, 5) == func)
        return Py_NewRef(info);
    if (PyErr_Occurred()) return NULL;
    info = PyObject_CallOneArg(R_op_info, func);
    if (info && (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 9)) {
        Py_DECREF(info);
        PyErr_SetString(PyExc_TypeError, "op_info: expected a 9-tuple");
        return NULL;
    }
    return info;
}

static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static Py_ssize_t attr_len(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    Py_ssize_t r = PyObject_Length(v);
    Py_DECREF(v);
    return r;
}

/* whether weak reference ref points at o */
static int weak_is(PyObject *ref, PyObject *o) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target = NULL;
    if (PyWeakref_GetRef(ref, &target) < 0) {
        PyErr_Clear();
        return 0;
    }
    int same = target == o;
    Py_XDECREF(target);
    return same;
#else
    return PyWeakref_GetObject(ref) == o;
#endif
}

/* a tensor's version counter, -1 for an inference tensor (it has none); -2 on error */
static long long tensor_version(PyObject *t) {
    PyObject *v = PyObject_GetAttr(t, N__version);
    if (!v) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError)) {
            PyErr_Clear();
            return -1;
        }
        return -2;
    }
    long long out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return out == -1 && PyErr_Occurred() ? -2 : out;
}

/* OpRecorder.set_producer for a tensor whose memory no live entry holds (none, or a freed storage's at the same
 * address): 1 when done, 0 when the caller takes set_producer, -1 on error */
static int enter_producer(PyObject *rec, PyObject *producers, PyObject *by_object, PyObject *t, PyObject *r,
                          PyObject *view) {
    int rc = -1;
    PyObject *ptr = NULL, *dtype = NULL, *shape = NULL, *stride = NULL, *device = NULL, *key = NULL, *expired = NULL,
             *ref = NULL, *entry = NULL, *id = NULL, *released = NULL, *wr = NULL, *obj_entry = NULL, *vo = NULL;
    long long v = tensor_version(t);
    if (v == -2) return -1;
    if (!(ptr = PyObject_CallMethodNoArgs(t, N_data_ptr)) || !(dtype = PyObject_GetAttr(t, N_dtype)) ||
        !(shape = PyObject_GetAttr(t, N_shape)) || !(stride = PyObject_CallMethodNoArgs(t, N_stride)) ||
        !(device = PyObject_GetAttr(t, N_device)) || !(key = PyTuple_Pack(5, ptr, dtype, shape, stride, device))) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError)) { /* no memory key (no storage, a nested tensor's sizes) */
            PyErr_Clear();
            rc = 0;
        }
        goto done;
    }
    PyObject *ent = PyDict_GetItemWithError(producers, key); /* borrowed */
    if (!ent && PyErr_Occurred()) goto done;
    if (ent) {
        if (view != Py_False || !PyTuple_Check(ent) || PyTuple_GET_SIZE(ent) != 4) {
            rc = 0;
            goto done;
        }
        if (!(expired = PyObject_CallOneArg(R_storage_expired, PyTuple_GET_ITEM(ent, 0)))) goto done;
        if (expired != Py_True) { /* live memory written again: set_producer's bookkeeping of aliases */
            rc = 0;
            goto done;
        }
        Py_INCREF(ent); /* kept until its storage reference is given back, after it is out of the table */
    }
    if (!(ref = PyObject_CallOneArg(R_weak_storage, t)) || !(id = PyLong_FromVoidPtr(t)) ||
        !(vo = PyLong_FromLongLong(v)) || !(entry = PyTuple_Pack(4, ref, r, vo, id)) ||
        PyDict_SetItem(producers, key, entry) < 0) {
        Py_XDECREF(ent);
        goto done;
    }
    if (ent) {
        released = PyObject_CallOneArg(R_storage_release, PyTuple_GET_ITEM(ent, 0));
        Py_DECREF(ent);
        if (!released) goto done;
    }
    if (!(wr = PyWeakref_NewRef(t, NULL))) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto done;
        PyErr_Clear(); /* a tensor subclass without weak references: the memory key alone */
    } else if (!(obj_entry = PyTuple_Pack(3, wr, r, vo)) || PyDict_SetItem(by_object, id, obj_entry) < 0) {
        goto done;
    }
    rc = 1;
done:
    Py_XDECREF(ptr); Py_XDECREF(dtype); Py_XDECREF(shape); Py_XDECREF(stride); Py_XDECREF(device); Py_XDECREF(key);
    Py_XDECREF(expired); Py_XDECREF(ref); Py_XDECREF(entry); Py_XDECREF(id); Py_XDECREF(released); Py_XDECREF(wr);
    Py_XDECREF(obj_entry); Py_XDECREF(vo);
    return rc;
}

/* OpRecorder._settle: register the last op's outputs; 0, or -1 on error */
static int settle(PyObject *rec) {
    PyObject *unsettled = PyObject_GetAttr(rec, N__unsettled), *fresh = PyList_New(0), *producers = NULL,
             *by_object = NULL;
    int rc = -1;
    if (!unsettled || !fresh || PyObject_SetAttr(rec, N__unsettled, fresh) < 0) goto done;
    if (!PyList_Check(unsettled)) {
        PyErr_SetString(PyExc_TypeError, "OpRecorder._unsettled: expected a list");
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(unsettled); i++) {
        PyObject *u = PyList_GET_ITEM(unsettled, i);
        if (!PyTuple_Check(u) || PyTuple_GET_SIZE(u) != 3) {
            PyErr_SetString(PyExc_TypeError, "OpRecorder._unsettled: expected (tensor, record, view) items");
            goto done;
        }
        /* looked up per item: set_producer may replace the identity table */
        Py_XDECREF(producers);
        Py_XDECREF(by_object);
        if (!(producers = PyObject_GetAttr(rec, N__producers)) || !(by_object = PyObject_GetAttr(rec, N__by_object)))
            goto done;
        int done_here = PyDict_CheckExact(producers) && PyDict_CheckExact(by_object)
            ? enter_producer(rec, producers, by_object, PyTuple_GET_ITEM(u, 0), PyTuple_GET_ITEM(u, 1),
                             PyTuple_GET_ITEM(u, 2))
            : 0;
        if (done_here < 0) goto done;
        if (!done_here) {
            PyObject *got = PyObject_CallMethodObjArgs(rec, N_set_producer, PyTuple_GET_ITEM(u, 0),
                                                       PyTuple_GET_ITEM(u, 1), PyTuple_GET_ITEM(u, 2), NULL);
            if (!got) goto done;
            Py_DECREF(got);
        }
    }
    rc = 0;
done:
    Py_XDECREF(unsettled);
    Py_XDECREF(fresh);
    Py_XDECREF(producers);
    Py_XDECREF(by_object);
    return rc;
}

/* OpRecorder._input for a tensor argument: its record (a new reference), or NULL on error */
static PyObject *input_record(PyObject *rec, PyObject *t, PyObject *source, PyObject *loc, PyObject *events,
                              PyObject *by_object, int grad_on) {
    long long v = tensor_version(t);
    if (v == -2) return NULL;
    PyObject *k = PyLong_FromVoidPtr(t);
    if (!k) return NULL;
    PyObject *ent = PyDict_GetItemWithError(by_object, k);
    Py_DECREF(k);
    if (!ent && PyErr_Occurred()) return NULL;
    PyObject *r = NULL;
    if (ent && PyTuple_Check(ent) && PyTuple_GET_SIZE(ent) == 3 && PyLong_Check(PyTuple_GET_ITEM(ent, 2)) &&
        PyLong_AsLongLong(PyTuple_GET_ITEM(ent, 2)) == v && weak_is(PyTuple_GET_ITEM(ent, 0), t)) {
        r = Py_NewRef(PyTuple_GET_ITEM(ent, 1)); /* an object an earlier op returned, unchanged since */
    } else {
        if (PyErr_Occurred()) return NULL;
        PyObject *pv = PyLong_FromLongLong(v);
        if (!pv) return NULL;
        r = PyObject_CallMethodObjArgs(rec, N__producer_by_memory, t, pv, NULL);
        Py_DECREF(pv);
        if (!r) return NULL;
        if (r == Py_None) { /* first seen: an input or parameter record of its own */
            Py_DECREF(r);
            return PyObject_CallMethodObjArgs(rec, N__input_record, t, source, loc, events, Py_False, Py_False, NULL);
        }
    }
    if (!grad_on) return r;
    int rg = attr_true(t, N_requires_grad);
    if (rg <= 0) {
        if (rg < 0) Py_CLEAR(r);
        return r;
    }
    /* OpRecorder._tag_grad_fn, called once per autograd node */
    PyObject *gf = PyObject_GetAttr(t, N_grad_fn);
    int tagged = 1;
    if (gf && gf != Py_None) {
        PyObject *md = PyObject_GetAttr(gf, N_metadata);
        tagged = md ? PySequence_Contains(md, R_fwd_key) : -1;
        Py_XDECREF(md);
    }
    PyObject *done = gf && tagged == 0 ? PyObject_CallMethodObjArgs(rec, N__tag_grad_fn, t, r, NULL) : NULL;
    int failed = !gf || tagged < 0 || (tagged == 0 && !done);
    Py_XDECREF(gf);
    Py_XDECREF(done);
    if (failed) Py_CLEAR(r);
    return r;
}

/* iter_args (determ_backend/modes/ops.py) of one argument with its path, (path, value) pairs appended to out */
static int describe_walk(PyObject *path, PyObject *a, PyObject *out) {
    int is = PyObject_IsInstance(a, R_Tensor);
    if (is < 0) return -1;
    int seq = 0;
    if (!is && (PyList_Check(a) || PyTuple_Check(a)) && PySequence_Size(a) > 0) {
        int size = PyObject_IsInstance(a, R_Size);
        if (size < 0) return -1;
        seq = !size;
    }
    if (!seq) {
        PyObject *pair = PyTuple_Pack(2, path, a);
        int rc = pair ? PyList_Append(out, pair) : -1;
        Py_XDECREF(pair);
        return rc;
    }
    PyObject *items = PySequence_Fast(a, "");
    if (!items) return -1;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(items); j++) {
        PyObject *p = PyUnicode_FromFormat("%U[%zd]", path, j);
        int rc = p ? describe_walk(p, PySequence_Fast_GET_ITEM(items, j), out) : -1;
        Py_XDECREF(p);
        if (rc < 0) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    return 0;
}

/* str(t.device), remembered per device (torch.device's str formats through a C++ stream) */
static PyObject *device_texts;

static PyObject *device_text(PyObject *t) {
    PyObject *d = PyObject_GetAttr(t, N_device);
    if (!d) return NULL;
    if (!device_texts && !(device_texts = PyDict_New())) {
        Py_DECREF(d);
        return NULL;
    }
    PyObject *s = PyDict_GetItemWithError(device_texts, d);
    if (s) {
        Py_DECREF(d);
        return Py_NewRef(s);
    }
    if (PyErr_Occurred() || !(s = PyObject_Str(d)) || (PyDict_GET_SIZE(device_texts) < 64 &&
                                                        PyDict_SetItem(device_texts, d, s) < 0)) {
        Py_XDECREF(s);
        s = NULL;
    }
    Py_DECREF(d);
    return s;
}

static PyObject *py_op_begin(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !RS) {
        PyErr_SetString(PyExc_TypeError, "op_begin(recorder, func, args, kwargs, frame, compiled) after setup_recorder");
        return NULL;
    }
    PyObject *rec = a[0], *func = a[1], *args = a[2], *kwargs = a[3], *frame = a[4], *compiled = a[5];
    PyObject *info = NULL, *node = NULL, *backward = NULL, *fwd = NULL, *source = NULL, *loc = NULL, *stack = NULL,
             *in_recs = NULL, *events = NULL, *tensors = NULL, *by_object = NULL, *arg_desc = NULL, *out = NULL;
    /* handed to OpRecorder.begin whole: a torch.distributed write seen before, out= arguments, a collective */
    int describe = attr_true(rec, N_describe_args);
    if (describe < 0) return NULL;
    PyObject *depth_o = PyObject_GetAttr(rec, N_stack_depth);
    if (!depth_o) return NULL;
    long depth = PyLong_AsLong(depth_o);
    Py_DECREF(depth_o);
    if (depth == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t silent = attr_len(rec, N__silent);
    if (silent < 0) return NULL;
    int whole = silent > 0 || !PyTuple_Check(args) || (kwargs != Py_None && !PyDict_Check(kwargs)) ||
                (frame != Py_None && !PyFrame_Check(frame));
    if (!whole) {
        if (!(info = op_facts(func))) return NULL;
        PyObject *outs = PyTuple_GET_ITEM(info, 7);
        whole = PyTuple_GET_ITEM(info, 6) == Py_True || !PyTuple_Check(outs) || PyTuple_GET_SIZE(outs) > 0;
    }
    if (whole) {
        Py_XDECREF(info);
        PyObject *argv[] = {rec, func, args, kwargs, frame, compiled};
        return PyObject_VectorcallMethod(N_begin, argv, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    Py_ssize_t unsettled = attr_len(rec, N__unsettled);
    if (unsettled < 0) goto fail;
    if (unsettled > 0 && settle(rec) < 0) goto fail;
    if (!(node = PyObject_CallNoArgs(R_node_getter))) goto fail;
    if (node != Py_None) {
        if (!(backward = PyObject_CallMethodNoArgs(node, N_name))) goto fail;
        int user = run_by_user(frame);
        if (user < 0) goto fail;
        if (!user) {
            PyObject *md = PyObject_GetAttr(node, N_metadata);
            if (!md) goto fail;
            fwd = PyObject_CallMethodOneArg(md, N_get, R_fwd_key);
            Py_DECREF(md);
            if (!fwd) goto fail;
            if (fwd == Py_None) Py_CLEAR(fwd);
            else if (!PyTuple_Check(fwd) || PyTuple_GET_SIZE(fwd) != 2) {
                PyErr_SetString(PyExc_TypeError, "op_begin: a node's forward source is (source, location)");
                goto fail;
            }
        }
    } else {
        backward = Py_NewRef(Py_None);
    }
    if (depth != 1) { /* several frames a record */
        if (where(rec, frame, depth, &source, &loc, &stack) < 0) goto fail;
    } else {
        stack = Py_NewRef(Py_None);
    }
    if (fwd) { /* named after the forward line that made its autograd node */
        Py_XSETREF(source, Py_NewRef(PyTuple_GET_ITEM(fwd, 0)));
        Py_XSETREF(loc, Py_NewRef(PyTuple_GET_ITEM(fwd, 1)));
    } else if (depth == 1 && where(rec, frame, 1, &source, &loc, NULL) < 0) {
        goto fail;
    }
    int grad_on = 0;
    if (node == Py_None) {
        PyObject *g = PyObject_CallNoArgs(R_grad_enabled);
        if (!g) goto fail;
        grad_on = g == Py_True;
        Py_DECREF(g);
    }
    if (!(in_recs = PyList_New(0)) || !(events = PyList_New(0)) || !(by_object = PyObject_GetAttr(rec, N__by_object)))
        goto fail;
    if (!PyDict_Check(by_object)) {
        PyErr_SetString(PyExc_TypeError, "OpRecorder._by_object: expected a dict");
        goto fail;
    }
    if (describe) { /* the text log's (path, record, value, device) of every argument */
        if (!(tensors = PyList_New(0)) || !(arg_desc = PyList_New(0))) goto fail;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
            PyObject *p = PyUnicode_FromFormat("args[%zd]", i);
            int rc = p ? describe_walk(p, PyTuple_GET_ITEM(args, i), tensors) : -1;
            Py_XDECREF(p);
            if (rc < 0) goto fail;
        }
        if (kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0) {
            PyObject *k, *v;
            Py_ssize_t pos = 0;
            while (PyDict_Next(kwargs, &pos, &k, &v)) {
                PyObject *p = PyUnicode_FromFormat("%S=", k);
                int rc = p ? describe_walk(p, v, tensors) : -1;
                Py_XDECREF(p);
                if (rc < 0) goto fail;
            }
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); i++) {
            PyObject *pair = PyList_GET_ITEM(tensors, i), *path = PyTuple_GET_ITEM(pair, 0),
                     *t = PyTuple_GET_ITEM(pair, 1), *d;
            int is = PyObject_IsInstance(t, R_Tensor);
            if (is < 0) goto fail;
            if (!is) {
                d = PyTuple_Pack(4, path, Py_None, t, Py_None);
            } else {
                PyObject *r = input_record(rec, t, source, loc, events, by_object, grad_on);
                if (!r) goto fail;
                PyObject *dev = PyList_Append(in_recs, r) == 0 ? device_text(t) : NULL;
                d = dev ? PyTuple_Pack(4, path, r, Py_None, dev) : NULL;
                Py_DECREF(r);
                Py_XDECREF(dev);
            }
            int rc = d ? PyList_Append(arg_desc, d) : -1;
            Py_XDECREF(d);
            if (rc < 0) goto fail;
        }
    } else {
        arg_desc = Py_NewRef(S_empty_tuple);
        if (!(tensors = PyList_New(0))) goto fail;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++)
            if (collect_tensors(PyTuple_GET_ITEM(args, i), tensors) < 0) goto fail;
        if (kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0) {
            PyObject *k, *v;
            Py_ssize_t pos = 0;
            while (PyDict_Next(kwargs, &pos, &k, &v))
                if (collect_tensors(v, tensors) < 0) goto fail;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); i++) {
            PyObject *r = input_record(rec, PyList_GET_ITEM(tensors, i), source, loc, events, by_object, grad_on);
            if (!r) goto fail;
            int rc = PyList_Append(in_recs, r);
            Py_DECREF(r);
            if (rc < 0) goto fail;
        }
    }
    out = PyTuple_Pack(9, info, source, loc, stack, backward, compiled, in_recs, arg_desc, events);
fail:
    Py_XDECREF(info);
    Py_XDECREF(node);
    Py_XDECREF(backward);
    Py_XDECREF(fwd);
    Py_XDECREF(source);
    Py_XDECREF(loc);
    Py_XDECREF(stack);
    Py_XDECREF(in_recs);
    Py_XDECREF(events);
    Py_XDECREF(tensors);
    Py_XDECREF(by_object);
    Py_XDECREF(arg_desc);
    return out;
}

/* OpRecorder._name: "<op>@<location><suffix>#<k>", the k-th of that base; a new reference */
static PyObject *op_name(PyObject *rec, PyObject *op, PyObject *loc, PyObject *suffix) {
    if (!PyUnicode_Check(op) || !PyUnicode_Check(loc) || !PyUnicode_Check(suffix)) {
        PyErr_SetString(PyExc_TypeError, "op_end: an op's name and location are strings");
        return NULL;
    }
    PyObject *counts = PyObject_GetAttr(rec, N__counts);
    if (!counts) return NULL;
    PyObject *base = PyUnicode_FromFormat("%U@%U%U", op, loc, suffix);
    PyObject *out = NULL;
    if (base && PyDict_Check(counts)) {
        PyObject *c = PyDict_GetItemWithError(counts, base);
        long long k = c ? PyLong_AsLongLong(c) : 0;
        if (!PyErr_Occurred()) {
            PyObject *next = PyLong_FromLongLong(k + 1);
            if (next && PyDict_SetItem(counts, base, next) == 0) out = PyUnicode_FromFormat("%U#%lld", base, k);
            Py_XDECREF(next);
        }
    } else if (base) {
        PyErr_SetString(PyExc_TypeError, "OpRecorder._counts: expected a dict");
    }
    Py_XDECREF(base);
    Py_DECREF(counts);
    return out;
}

/* OpRecorder._record(node, op, "node", source, t, inputs, extra); a new reference */
static PyObject *new_record(PyObject *rec, PyObject *node, PyObject *op, PyObject *source, PyObject *t, PyObject *inputs,
                            PyObject *extra, int is_tensor) {
    PyObject *seq = PyObject_GetAttr(rec, N_seq), *dtype = NULL, *shape = NULL, *names = NULL, *in_hashes = NULL,
             *rank = NULL, *run = NULL, *out = NULL;
    if (!seq) return NULL;
    PyObject *next = PyNumber_Add(seq, S_one);
    if (!next || PyObject_SetAttr(rec, N_seq, next) < 0) goto done;
    if (is_tensor) {
        PyObject *dt = PyObject_GetAttr(t, N_dtype);
        if (!dt) goto done;
        dtype = PyDict_GetItemWithError(R_dtype_names, dt);
        if (dtype) Py_INCREF(dtype);
        else if (!PyErr_Occurred()) dtype = PyObject_CallOneArg(R_dtype_name, dt);
        Py_DECREF(dt);
        if (!dtype) goto done;
        int nested = attr_true(t, N_is_nested);
        if (nested < 0) goto done;
        if (nested) {
            shape = PyList_New(0);
        } else {
            PyObject *s = PyObject_GetAttr(t, N_shape);
            shape = s ? PySequence_List(s) : NULL;
            Py_XDECREF(s);
        }
    } else {
        PyObject *tn = PyType_GetName(Py_TYPE(t));
        dtype = tn ? PyUnicode_FromFormat("py_%U", tn) : NULL;
        Py_XDECREF(tn);
        shape = PyList_New(0);
    }
    if (!dtype || !shape) goto done;
    Py_ssize_t n = PyList_GET_SIZE(inputs);
    if (!(names = PyList_New(n))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *nm = PyObject_GetAttr(PyList_GET_ITEM(inputs, i), N_node);
        if (!nm) goto done;
        PyList_SET_ITEM(names, i, nm);
    }
    if (!(in_hashes = PyList_New(0)) || !(rank = PyObject_GetAttr(rec, N_rank)) || !(run = PyObject_GetAttr(rec, N_run)))
        goto done;
    /* graph, stage, node, op, kind, call, seq, source, dtype, shape, hash, stats, inputs, in_hashes, rank, run,
     * payload, extra */
    PyObject *argv[] = {S_eager, S_eager, node, op, S_node_kind, S_zero, seq, source, dtype, shape,
                        Py_None, Py_None, names, in_hashes, rank, run, Py_None, extra};
    out = PyObject_Vectorcall(R_Record, argv, 18, NULL);
done:
    Py_DECREF(seq);
    Py_XDECREF(next);
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(names);
    Py_XDECREF(in_hashes);
    Py_XDECREF(rank);
    Py_XDECREF(run);
    return out;
}

/* PendingHashes.add through FingerprintBatch.add_now for a plain contiguous CPU tensor the kernel reads right
 * now: 1 when done, 0 when declined (the caller takes OpRecorder._capture), -1 on error */
static int capture_now(PyObject *rec, PyObject *r, PyObject *t) {
    if (Py_TYPE(t) != (PyTypeObject *)R_Tensor && Py_TYPE(t) != (PyTypeObject *)R_Parameter) return 0;
    int rc = -1;
    PyObject *hashes = NULL, *batch = NULL, *kernel = NULL, *layout = NULL, *dtype = NULL, *key = NULL, *shape = NULL, *threads = NULL, *numel = NULL, *ptr_o = NULL, *nbytes_o = NULL,
             *zero = NULL, *entry = NULL, *stats = NULL, *outl = NULL, *items = NULL, *item = NULL, *pos = NULL,
             *total = NULL, *want_o = NULL;
    if (!(layout = PyObject_GetAttr(t, N_layout))) goto done;
    if (layout != R_strided) goto decline;
    int b;
    if ((b = attr_true(t, N_is_meta)) != 0 || (b = attr_true(t, N_is_nested)) != 0) goto checked;
    if ((b = attr_true(t, N_is_cpu)) != 1) goto checked;
    if ((b = attr_true(t, N_is_quantized)) != 0) goto checked;
    if (!(hashes = PyObject_GetAttr(rec, N__hashes)) || !(batch = PyObject_GetAttr(hashes, N__batch))) goto done;
    if ((b = attr_true(batch, N__looked_up)) != 1) goto checked;
    if (!(kernel = PyObject_GetAttr(batch, N__kernel))) goto done;
    if (kernel == Py_None) goto decline;
    PyObject *m;
    if (!(m = PyObject_CallMethodNoArgs(t, N_is_conj))) goto done;
    b = m == Py_True; Py_DECREF(m);
    if (b) goto decline;
    if (!(m = PyObject_CallMethodNoArgs(t, N_is_neg))) goto done;
    b = m == Py_True; Py_DECREF(m);
    if (b) goto decline;
    if (!(zero = PyObject_CallOneArg(R_is_zero, t))) goto done;
    if (zero != Py_False) goto decline;
    if (!(m = PyObject_CallMethodNoArgs(t, N_is_contiguous))) goto done;
    b = m == Py_True; Py_DECREF(m);
    if (!b) goto decline;
    if (!(want_o = PyObject_GetAttr(batch, N__want))) goto done;
    int want = want_o == Py_True;
    if (!(dtype = PyObject_GetAttr(t, N_dtype))) goto done;
    PyObject *kind_o = PyDict_GetItemWithError(R_supported, dtype); /* borrowed */
    if (!kind_o && PyErr_Occurred()) goto done;
    long kind = kind_o ? PyLong_AsLong(kind_o) : 0;
    if (want && !kind) goto decline;
    if (!(numel = PyObject_CallMethodNoArgs(t, N_numel)) || !(nbytes_o = PyObject_GetAttr(t, N_nbytes))) goto done;
    long long n = PyLong_AsLongLong(numel), nbytes = PyLong_AsLongLong(nbytes_o);
    if (PyErr_Occurred()) goto done;
    unsigned long long ptr = 0;
    if (n) {
        if (!(ptr_o = PyObject_CallMethodNoArgs(t, N_data_ptr))) goto done;
        ptr = PyLong_AsUnsignedLongLongMask(ptr_o);
    }
    if (!(shape = PyObject_GetAttr(t, N_shape)) || !(key = PyObject_CallFunctionObjArgs(R_key, dtype, shape, NULL)) ||
        !(threads = PyObject_GetAttr(kernel, N_threads)))
        goto done;
    unsigned long long k = PyLong_AsUnsignedLongLongMask(key);
    long nthreads = PyLong_AsLong(threads);
    if (PyErr_Occurred() || nbytes < 0 || n < 0) goto done;
    uint64_t h = 0;
    double v[7];
    if (fingerprint_holding(ptr, nbytes, (int)kind, n, k, (int)nthreads, &h, want ? v : NULL) != 0)
        goto decline; /* not initialized, or no scratch memory: the Python path says so */
    if (want) {
        PyObject *vec = Py_BuildValue("(ddddddd)", v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
        PyObject *first = vec ? PyObject_GetAttr(batch, N__max_first) : NULL;
        stats = first ? PyObject_CallFunctionObjArgs(R_stats_dict, vec, first, NULL) : NULL;
        Py_XDECREF(vec);
        Py_XDECREF(first);
        if (!stats) goto done;
    } else {
        stats = Py_NewRef(Py_None);
    }
    if (!(entry = Py_BuildValue("(KO)", (unsigned long long)h, stats)) || !(outl = PyObject_GetAttr(batch, N__out)) ||
        PyList_Append(outl, entry) < 0)
        goto done;
    if (!(pos = PyLong_FromSsize_t(PyList_GET_SIZE(outl) - 1)) || !(item = PyTuple_Pack(2, r, pos)) ||
        !(items = PyObject_GetAttr(hashes, N__items)) || PyList_Append(items, item) < 0)
        goto done;
    PyObject *had = PyObject_GetAttr(hashes, N_nbytes);
    if (!had) goto done;
    total = PyNumber_Add(had, nbytes_o);
    Py_DECREF(had);
    if (!total || PyObject_SetAttr(hashes, N_nbytes, total) < 0) goto done;
    rc = 1;
    goto done;
checked: /* a check that did not pass: declined, or an error */
    if (b < 0) goto done;
decline:
    rc = 0;
done:
    Py_XDECREF(hashes); Py_XDECREF(batch); Py_XDECREF(kernel); Py_XDECREF(layout); Py_XDECREF(dtype);
    Py_XDECREF(key); Py_XDECREF(shape); Py_XDECREF(threads); Py_XDECREF(numel); Py_XDECREF(ptr_o);
    Py_XDECREF(nbytes_o); Py_XDECREF(zero); Py_XDECREF(entry); Py_XDECREF(stats); Py_XDECREF(outl);
    Py_XDECREF(items); Py_XDECREF(item); Py_XDECREF(pos); Py_XDECREF(total); Py_XDECREF(want_o);
    return rc;
}

static PyObject *geometry_of(PyObject *t) { /* (str(dtype), tuple(shape), stride(), bytes before the first element) */
    PyObject *dtype = PyObject_GetAttr(t, N_dtype), *dtext = dtype ? PyObject_Str(dtype) : NULL;
    PyObject *shape = dtext ? PyObject_GetAttr(t, N_shape) : NULL, *tshape = shape ? PySequence_Tuple(shape) : NULL;
    PyObject *stride = tshape ? PyObject_CallMethodNoArgs(t, N_stride) : NULL;
    PyObject *off = stride ? PyObject_CallMethodNoArgs(t, N_storage_offset) : NULL;
    PyObject *size = off ? PyObject_CallMethodNoArgs(t, N_element_size) : NULL;
    PyObject *bytes = size ? PyNumber_Multiply(off, size) : NULL;
    PyObject *out = bytes ? PyTuple_Pack(4, dtext, tshape, stride, bytes) : NULL;
    Py_XDECREF(dtype); Py_XDECREF(dtext); Py_XDECREF(shape); Py_XDECREF(tshape); Py_XDECREF(stride); Py_XDECREF(off);
    Py_XDECREF(size); Py_XDECREF(bytes);
    return out;
}

/* OpRecorder._hash_output for a copy or a view (copy_arg, is_view) whose source is a tensor argument with a
 * record: the source's fingerprint (same values) or one derived from it (PendingHashes.add_same / add_view);
 * 1 when done, 2 when the output holds values of its own to read, 0 when the caller takes _hash_output, -1 on
 * error */
static int hash_from_source(PyObject *rec, PyObject *r, PyObject *t, PyObject *is_view, PyObject *copy_arg,
                            PyObject *args, PyObject *in_recs) {
    Py_ssize_t src_i = copy_arg == Py_None ? 0 : PyLong_AsSsize_t(copy_arg);
    if (src_i == -1 && PyErr_Occurred()) return -1;
    if (src_i < 0 || !PyTuple_Check(args) || src_i >= PyTuple_GET_SIZE(args) || PyList_GET_SIZE(in_recs) <= src_i)
        return 0;
    if (Py_TYPE(t) != (PyTypeObject *)R_Tensor && Py_TYPE(t) != (PyTypeObject *)R_Parameter) return 0;
    PyObject *src = PyTuple_GET_ITEM(args, src_i);
    for (Py_ssize_t i = 0; i <= src_i; i++) {
        int is = PyObject_IsInstance(PyTuple_GET_ITEM(args, i), R_Tensor);
        if (is <= 0) return is;
    }
    PyObject *layout = PyObject_GetAttr(t, N_layout);
    if (!layout) return -1;
    int plain = layout == R_strided;
    Py_DECREF(layout);
    if (!plain) return 0;
    int b;
    if ((b = attr_true(t, N_is_meta)) != 0 || (b = attr_true(t, N_is_nested)) != 0) return b < 0 ? -1 : 0;
    PyObject *base = PyList_GET_ITEM(in_recs, src_i), *items = NULL, *item = NULL;
    int rc = -1, same = 0;
    PyObject *a = PyObject_GetAttr(t, N_dtype), *c = a ? PyObject_GetAttr(src, N_dtype) : NULL;
    same = c ? PyObject_RichCompareBool(a, c, Py_EQ) : -1;
    Py_XDECREF(a); Py_XDECREF(c);
    if (same == 1) {
        a = PyObject_GetAttr(t, N_shape), c = a ? PyObject_GetAttr(src, N_shape) : NULL;
        same = c ? PyObject_RichCompareBool(a, c, Py_EQ) : -1;
        Py_XDECREF(a); Py_XDECREF(c);
    }
    if (same == 1 && is_view != Py_False) { /* same_layout */
        a = PyObject_CallMethodNoArgs(t, N_stride), c = a ? PyObject_CallMethodNoArgs(src, N_stride) : NULL;
        same = c ? PyObject_RichCompareBool(a, c, Py_EQ) : -1;
        Py_XDECREF(a); Py_XDECREF(c);
        if (same == 1) {
            a = PyObject_CallMethodNoArgs(t, N_storage_offset), c = a ? PyObject_CallMethodNoArgs(src, N_storage_offset) : NULL;
            same = c ? PyObject_RichCompareBool(a, c, Py_EQ) : -1;
            Py_XDECREF(a); Py_XDECREF(c);
        }
    }
    if (same < 0) return -1;
    PyObject *hashes = PyObject_GetAttr(rec, N__hashes);
    if (!hashes || !(items = PyObject_GetAttr(hashes, N__items))) goto done;
    if (same) { /* same logical values: same fingerprint */
        if (!(item = PyTuple_Pack(2, r, base)) || PyList_Append(items, item) < 0) goto done;
        rc = 1;
    } else if (is_view != Py_False) { /* PendingHashes.add_view: derived from the base's, by view_geometry */
        PyObject *gs = geometry_of(src), *go = gs ? geometry_of(t) : NULL, *geom = NULL;
        if (go) {
            PyObject *offset = PyNumber_Subtract(PyTuple_GET_ITEM(go, 3), PyTuple_GET_ITEM(gs, 3));
            if (offset)
                geom = PyTuple_Pack(7, PyTuple_GET_ITEM(gs, 0), PyTuple_GET_ITEM(gs, 1), PyTuple_GET_ITEM(gs, 2),
                                    PyTuple_GET_ITEM(go, 0), PyTuple_GET_ITEM(go, 1), PyTuple_GET_ITEM(go, 2), offset);
            Py_XDECREF(offset);
        }
        Py_XDECREF(gs); Py_XDECREF(go);
        if (!geom) goto done;
        PyObject *old = PyObject_GetAttr(r, N_extra), *extra = NULL;
        if (old) {
            extra = old == Py_None ? PyDict_New() : PyDict_Copy(old); /* dict(rec.extra or {}, derived_hash=True) */
            if (extra && (PyDict_SetItem(extra, S_derived_hash, Py_True) < 0 || PyObject_SetAttr(r, N_extra, extra) < 0))
                Py_CLEAR(extra);
        }
        Py_XDECREF(old);
        if (!extra || !(item = PyTuple_Pack(3, r, base, geom)) || PyList_Append(items, item) < 0) {
            Py_XDECREF(extra);
            Py_DECREF(geom);
            goto done;
        }
        Py_DECREF(extra);
        Py_DECREF(geom);
        rc = 1;
    } else {
        rc = 2; /* new values (a copy to another dtype or shape): read them */
    }
done:
    Py_XDECREF(hashes);
    Py_XDECREF(items);
    Py_XDECREF(item);
    return rc;
}

static PyObject *py_op_end(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !RS || !PyTuple_Check(a[1]) || PyTuple_GET_SIZE(a[1]) != 9) {
        PyErr_SetString(PyExc_TypeError, "op_end(recorder, context, result, args, kwargs, nondeterministic)");
        return NULL;
    }
    PyObject *rec = a[0], *ctx = a[1], *result = a[2], *args = a[3], *kwargs = a[4], *nondet = a[5];
    PyObject *info = PyTuple_GET_ITEM(ctx, 0), *source = PyTuple_GET_ITEM(ctx, 1), *loc = PyTuple_GET_ITEM(ctx, 2),
             *stack = PyTuple_GET_ITEM(ctx, 3), *backward = PyTuple_GET_ITEM(ctx, 4),
             *compiled = PyTuple_GET_ITEM(ctx, 5), *in_recs = PyTuple_GET_ITEM(ctx, 6),
             *arg_desc = PyTuple_GET_ITEM(ctx, 7), *events = PyTuple_GET_ITEM(ctx, 8);
    /* handed to OpRecorder.end whole: memory taken from elsewhere, values that may have been substituted, a
     * collective */
    int whole = !PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 9 || PyObject_IsTrue(PyTuple_GET_ITEM(info, 8)) ||
                PyObject_IsTrue(PyTuple_GET_ITEM(info, 6)) || nondet != Py_False || !PyList_Check(in_recs) ||
                !PyList_Check(events);
    if (PyErr_Occurred()) return NULL;
    if (whole) {
        PyObject *argv[] = {rec, ctx, result, args, kwargs, nondet};
        return PyObject_VectorcallMethod(N_end, argv, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    int describe = attr_true(rec, N_describe_args);
    if (describe < 0) return NULL;
    PyObject *uninit = PyTuple_GET_ITEM(info, 2); /* positions of the outputs that hold garbage memory */
    int any_garbage = !PyFrozenSet_CheckExact(uninit) || PySet_GET_SIZE(uninit) != 0;
    PyObject *writes = PyTuple_GET_ITEM(info, 0), *is_view = PyTuple_GET_ITEM(info, 1),
             *copy_arg = PyTuple_GET_ITEM(info, 3), *op = PyTuple_GET_ITEM(info, 4);
    PyObject *outs = NULL, *base = NULL, *extra = NULL, *recs = NULL, *unsettled = NULL, *ev = NULL,
             *all_events = NULL, *ret = NULL;
    int nwrites = PyObject_IsTrue(writes);
    if (nwrites < 0) return NULL;
    int result_tensor = PyObject_IsInstance(result, R_Tensor);
    if (result_tensor < 0) return NULL;
    int only_result = result_tensor && !nwrites; /* the op returned the one tensor it made or wrote */
    if (nwrites && result_tensor && PyTuple_Check(writes) && PyTuple_Check(args)) { /* an in-place op */
        only_result = 1;
        for (Py_ssize_t w = 0; w < PyTuple_GET_SIZE(writes); w++) {
            PyObject *pos = PyTuple_GET_ITEM(writes, w);
            Py_ssize_t i = PyTuple_Check(pos) && PyTuple_GET_SIZE(pos) == 2 ? PyLong_AsSsize_t(PyTuple_GET_ITEM(pos, 0))
                                                                            : -1;
            if (i == -1 && PyErr_Occurred()) return NULL;
            if (i < 0 || i >= PyTuple_GET_SIZE(args) || PyTuple_GET_ITEM(args, i) != result) only_result = 0;
        }
    }
    if (only_result) {
        outs = PyList_New(1);
        if (!outs) return NULL;
        PyList_SET_ITEM(outs, 0, Py_NewRef(result));
    } else {
        outs = PyObject_CallFunctionObjArgs(R_written_tensors, result, writes, args, kwargs, NULL);
        if (!outs) return NULL;
        if (!PyList_Check(outs)) {
            PyErr_SetString(PyExc_TypeError, "written_tensors: expected a list");
            goto done;
        }
    }
    int has_stack = PyObject_IsTrue(stack), has_bw = PyObject_IsTrue(backward), has_c = PyObject_IsTrue(compiled);
    if (has_stack < 0 || has_bw < 0 || has_c < 0) goto done;
    if (!(base = op_name(rec, op, loc, has_bw ? S_bw : S_empty_str))) goto done;
    if (has_stack || has_bw || has_c) { /* OpRecorder._extra, in its key order */
        if (!(extra = PyDict_New())) goto done;
        if ((has_stack && PyDict_SetItem(extra, S_stack, stack) < 0) ||
            (has_bw && PyDict_SetItem(extra, S_backward, backward) < 0) ||
            (has_c && PyDict_SetItem(extra, S_compiled_region, S_eager) < 0))
            goto done;
    } else {
        extra = Py_NewRef(Py_None);
    }
    Py_ssize_t n = PyList_GET_SIZE(outs);
    if (!(recs = PyList_New(0)) || !(unsettled = PyObject_GetAttr(rec, N__unsettled))) goto done;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *t = PyList_GET_ITEM(outs, j);
        int is_tensor = PyObject_IsInstance(t, R_Tensor);
        if (is_tensor < 0) goto done;
        PyObject *nm = n == 1 ? Py_NewRef(base) : PyUnicode_FromFormat("%U.%zd", base, j);
        if (!nm) goto done;
        PyObject *r = new_record(rec, nm, op, source, t, in_recs, extra, is_tensor);
        Py_DECREF(nm);
        if (!r) goto done;
        int rc = PyList_Append(recs, r);
        Py_DECREF(r);
        if (rc < 0) goto done;
        int garbage = 0; /* an output of memory as allocated: hashed by what is defined, dtype and shape */
        if (any_garbage) {
            PyObject *jo = PyLong_FromSsize_t(j);
            garbage = jo ? PySequence_Contains(uninit, jo) : -1;
            Py_XDECREF(jo);
            if (garbage < 0) goto done;
        }
        if (garbage) {
            PyObject *h = PyObject_CallOneArg(R_uninitialized_hash, r);
            rc = h ? PyObject_SetAttr(r, N_hash, h) : -1;
            Py_XDECREF(h);
            if (rc < 0) goto done;
        } else { /* OpRecorder._hash_output: most ops make new values (2: read them); copies and views take their
                  * source's fingerprint */
            int got = copy_arg == Py_None && is_view == Py_False
                ? 2 : hash_from_source(rec, r, t, is_view, copy_arg, args, in_recs);
            int fresh = got == 2;
            if (fresh) got = capture_now(rec, r, t);
            if (got < 0) goto done;
            if (!got) { /* declined: the Python method does it */
                PyObject *done_py = fresh
                    ? PyObject_CallMethodObjArgs(rec, N__capture, r, t, NULL)
                    : PyObject_CallMethodObjArgs(rec, N__hash_output, r, t, is_view, copy_arg, args, in_recs, NULL);
                if (!done_py) goto done;
                Py_DECREF(done_py);
            }
        }
        if (is_tensor) {
            PyObject *u = PyTuple_Pack(3, t, r, is_view);
            if (!u) goto done;
            rc = PyList_Append(unsettled, u);
            Py_DECREF(u);
            if (rc < 0) goto done;
        }
    }
    if (nwrites) { /* OpRecorder._written_through_view, when a view among the outputs was written */
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *t = PyList_GET_ITEM(outs, j);
            int is_tensor = PyObject_IsInstance(t, R_Tensor);
            if (is_tensor < 0) goto done;
            if (!is_tensor) continue;
            PyObject *b = PyObject_GetAttr(t, N__base);
            if (!b) goto done;
            int view = b != Py_None;
            Py_DECREF(b);
            if (view) {
                PyObject *got = PyObject_CallMethodOneArg(rec, N__written_through_view, outs);
                if (!got) goto done;
                Py_DECREF(got);
                break;
            }
        }
    }
    if (has_c) {
        PyObject *c = PyObject_GetAttr(rec, N_compiled_ops);
        PyObject *c1 = c ? PyNumber_Add(c, S_one) : NULL;
        int rc = c1 ? PyObject_SetAttr(rec, N_compiled_ops, c1) : -1;
        Py_XDECREF(c);
        Py_XDECREF(c1);
        if (rc < 0) goto done;
    }
    PyObject *devices = S_empty_tuple; /* the text log's device of each output */
    Py_INCREF(devices);
    if (describe) {
        Py_DECREF(devices);
        if (!(devices = PyList_New(n))) goto done;
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *t = PyList_GET_ITEM(outs, j);
            int is_tensor = PyObject_IsInstance(t, R_Tensor);
            PyObject *d = is_tensor > 0 ? device_text(t) : is_tensor == 0 ? PyUnicode_FromString("host") : NULL;
            if (!d) {
                Py_DECREF(devices);
                goto done;
            }
            PyList_SET_ITEM(devices, j, d);
        }
    }
    PyObject *argv[] = {op, source, stack, arg_desc, recs, devices, in_recs, backward, compiled};
    ev = PyObject_Vectorcall(R_OpEvent, argv, 9, NULL);
    Py_DECREF(devices);
    if (!ev || PyList_Append(events, ev) < 0) goto done;
    if (!(all_events = PyObject_GetAttr(rec, N__events))) goto done;
    if (!PyList_Check(all_events) ||
        PyList_SetSlice(all_events, PyList_GET_SIZE(all_events), PyList_GET_SIZE(all_events), events) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "OpRecorder._events: expected a list");
        goto done;
    }
    { /* the flush OpRecorder.end asks for, when it is due */
        PyObject *hashes = PyObject_GetAttr(rec, N__hashes);
        if (!hashes) goto done;
        Py_ssize_t pending = attr_len(hashes, N__items);
        PyObject *nb = pending >= 0 ? PyObject_GetAttr(hashes, N_nbytes) : NULL;
        Py_DECREF(hashes);
        PyObject *bo = nb ? PyObject_GetAttr(rec, N_batch) : NULL;
        if (!bo) {
            Py_XDECREF(nb);
            goto done;
        }
        long long nbytes = PyLong_AsLongLong(nb), batch = PyLong_AsLongLong(bo);
        Py_DECREF(nb);
        Py_DECREF(bo);
        if (PyErr_Occurred()) goto done;
        if (pending >= PyLong_AsLongLong(R_host_batch) || pending >= batch ||
            nbytes >= PyLong_AsLongLong(R_flush_bytes)) {
            PyObject *got = PyObject_CallMethodNoArgs(rec, N__flush_due);
            if (!got) goto done;
            Py_DECREF(got);
        }
    }
    ret = Py_NewRef(recs);
done:
    Py_XDECREF(outs);
    Py_XDECREF(base);
    Py_XDECREF(extra);
    Py_XDECREF(recs);
    Py_XDECREF(unsettled);
    Py_XDECREF(ev);
    Py_XDECREF(all_events);
    return ret;
}

#endif /* the recorder */

static PyMethodDef methods[] = {
    {"first_listed_not", (PyCFunction)(void (*)(void))py_first_listed_not, METH_FASTCALL,
     "first_listed_not(frame, internal)"},
    {"fingerprint", (PyCFunction)(void (*)(void))py_fingerprint, METH_FASTCALL,
     "fingerprint(data_ptr, nbytes, kind, numel, key, nthreads, stats)"},
    {"init", py_init, METH_O, "init(weights_ptr)"},
    {"trace_lines", (PyCFunction)(void (*)(void))py_trace_lines, METH_FASTCALL, "trace_lines(call, rows, dumps)"},
#if PY_VERSION_HEX >= 0x030B0000
    {"setup_recorder", py_setup_recorder, METH_O, "setup_recorder(names)"},
    {"op_begin", (PyCFunction)(void (*)(void))py_op_begin, METH_FASTCALL,
     "op_begin(recorder, func, args, kwargs, frame, compiled)"},
    {"op_end", (PyCFunction)(void (*)(void))py_op_end, METH_FASTCALL,
     "op_end(recorder, context, result, args, kwargs, nondeterministic)"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "determ_fp", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_determ_fp(void) { return PyModule_Create(&module); }
#endif
