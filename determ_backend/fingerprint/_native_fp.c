/* One-pass CPU kernel for determ's tensor fingerprint and statistics.
 *
 * determ_fp() reads a contiguous buffer once, row by row (a row is ROW_WORDS
 * int32 words, 16 KiB, so the statistics pass over a row hits L1; large buffers
 * are split by rows over OpenMP threads), and returns
 *   - the 64-bit fingerprint defined in determ_backend/fingerprint.py (exact
 *     integer arithmetic mod 2**64: bit-identical to the torch and Triton paths);
 *   - optionally [min, max, sum, sum of squares, nan count, inf count] in double.
 *
 * Built on first use by determ_backend/_native.py with the system C compiler and
 * loaded with ctypes; when no compiler is available determ uses the torch path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#define LANES 8
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

static uint64_t row_sum(const int32_t *w, int64_t n, const uint64_t *k) {
    /* LANES independent accumulators: the loop vectorizes (64-bit lane multiplies) */
    uint64_t acc[LANES] = {0};
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += (uint64_t)(int64_t)w[c + j] * k[c + j];
    for (; c < n; c++) acc[0] += (uint64_t)(int64_t)w[c] * k[c];
    uint64_t s = 0;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
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

typedef struct { double mn, mx, sum, sq, nan, inf; } stats_t;

/* Floating-point elements, exact class handling: NaNs are counted and left out of min/max
 * (the caller makes min/max NaN when any is present, as torch.aminmax does) and propagate
 * into the sum. */
#define FLOAT_STATS(EXPR)                                            \
    for (int64_t i = 0; i < n; i++) {                                \
        double x = (double)(EXPR);                                   \
        if (x != x) { st->nan += 1; st->sum += x; continue; }        \
        if (isinf(x)) st->inf += 1;                                  \
        if (x < st->mn) st->mn = x;                                  \
        if (x > st->mx) st->mx = x;                                  \
        st->sum += x;                                                \
        st->sq += x * x;                                             \
    }

#define INT_STATS(T)                                                 \
    for (int64_t i = 0; i < n; i++) {                                \
        double x = (double)((const T *)p)[i];                        \
        if (x < st->mn) st->mn = x;                                  \
        if (x > st->mx) st->mx = x;                                  \
        st->sum += x;                                                \
        st->sq += x * x;                                             \
    }

/* float32 elements in LANES fixed lanes (GCC/Clang vector extensions: vectorized, and a
 * fixed summation order); NaN and inf are counted in a second vector pass over the block
 * only when its sums show that some are present. */
static void f32_stats(const float *f, int64_t n, stats_t *st) {
    v8f vmn, vmx;
    v8d vs = {0}, vq = {0};
    int64_t i = 0;
    if (n >= LANES) {
        memcpy(&vmn, f, sizeof vmn);
        vmx = vmn;
    }
    for (; i + LANES <= n; i += LANES) {
        v8f a;
        memcpy(&a, f + i, sizeof a);
        v8i lt = a < vmn, gt = a > vmx;
        vmn = (v8f)(((v8i)a & lt) | ((v8i)vmn & ~lt));
        vmx = (v8f)(((v8i)a & gt) | ((v8i)vmx & ~gt));
        v8d d = __builtin_convertvector(a, v8d);
        vs += d;
        vq += d * d;
    }
    double s = 0.0, q = 0.0;
    float fmn = (float)INFINITY, fmx = -(float)INFINITY;
    for (int j = 0; j < LANES && n >= LANES; j++) {
        s += vs[j];
        q += vq[j];
        fmn = vmn[j] < fmn ? vmn[j] : fmn;
        fmx = vmx[j] > fmx ? vmx[j] : fmx;
    }
    for (; i < n; i++) {
        float a = f[i];
        fmn = a < fmn ? a : fmn;
        fmx = a > fmx ? a : fmx;
        s += (double)a;
        q += (double)a * (double)a;
    }
    if (!(isfinite(s) && isfinite(q))) {
        /* NaN or inf present: the comparisons above already left NaNs out of min/max, and a
         * non-finite sum is the same in any order; only the counts are missing */
        v8i vnan = {0}, vinf = {0};
        const v8i absmask = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                             0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
        const v8i infbits = {0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000,
                             0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000};
        int64_t c = 0;
        for (; c + LANES <= n; c += LANES) {
            v8i a;
            memcpy(&a, f + c, sizeof a);
            v8i mag = a & absmask;
            vnan -= mag > infbits; /* exponent all ones, mantissa non-zero */
            vinf -= mag == infbits;
        }
        for (int j = 0; j < LANES; j++) {
            st->nan += vnan[j];
            st->inf += vinf[j];
        }
        for (; c < n; c++) {
            if (f[c] != f[c]) st->nan += 1;
            else if (isinf(f[c])) st->inf += 1;
        }
    }
    if ((double)fmn < st->mn) st->mn = fmn;
    if ((double)fmx > st->mx) st->mx = fmx;
    st->sum += s;
    st->sq += q;
}

#define CHUNK 1024

/* 16-bit floats: widened to float32 a chunk at a time, then as float32 (exact: every
 * half and bfloat16 value is a float32 value). */
#define HALF_STATS(CONV)                                             \
    {                                                                \
        const uint16_t *h = (const uint16_t *)p;                     \
        float buf[CHUNK];                                            \
        for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {                  \
            int64_t m = n - c0 < CHUNK ? n - c0 : CHUNK;             \
            for (int64_t i = 0; i < m; i++) buf[i] = CONV(h[c0 + i]); \
            f32_stats(buf, m, st);                                   \
        }                                                            \
    }

static void elem_stats(const void *p, int64_t n, int kind, stats_t *st) {
    switch (kind) {
    case K_F32: f32_stats((const float *)p, n, st); break;
    case K_F64: FLOAT_STATS(((const double *)p)[i]) break;
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
    const uint64_t *k;
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
    if (b->do_stats) {
        /* the row's elements (a 16 KiB row holds whole elements of every supported kind) */
        int64_t b0 = 4 * w0, b1 = 4 * (w0 + nw) < b->nbytes ? 4 * (w0 + nw) : b->nbytes;
        stats_t fresh = {INFINITY, -INFINITY, 0.0, 0.0, 0.0, 0.0};
        *rs = fresh;
        elem_stats(b->bytes + b0, (b1 - b0) / b->elem, b->kind, rs);
    }
    return fmix(row_sum(w, nw, b->k) ^ fmix((uint64_t)(r + 1) * GOLDEN));
}

#define ROWS_PER_THREAD 64 /* 1 MiB: below that a thread costs more than it saves */

/* Fingerprint (and statistics) of nbytes of contiguous data holding numel elements of
 * the given kind.  k: the ROW_WORDS column weights; key: the dtype/shape key.
 * stats_out (when not NULL): min, max, sum, sum of squares, nan count, inf count.
 * Large buffers are split by rows over up to nthreads OpenMP threads (torch's own pool
 * when torch's libgomp is the one loaded); results do not depend on the split: row sums
 * combine exactly, statistics are kept per row and combined in row order.
 * Returns 0, or -1 when scratch memory cannot be allocated. */
int determ_fp(const void *data, int64_t nbytes, int kind, int64_t numel, const uint64_t *k, uint64_t key,
              int nthreads, uint64_t *hash_out, double *stats_out) {
    buf_t b;
    b.bytes = (const unsigned char *)data;
    b.nbytes = nbytes;
    b.elem = numel > 0 ? nbytes / numel : 0;
    b.full_words = nbytes / 4;
    b.nwords = b.full_words + (nbytes % 4 ? 1 : 0);
    b.kind = kind;
    b.do_stats = stats_out != NULL && kind != K_NONE && b.elem > 0;
    b.k = k;
    int64_t rows = (b.nwords + ROW_WORDS - 1) / ROW_WORDS;
    stats_t one;
    stats_t *row_stats = &one;
    if (b.do_stats && rows > 1) {
        row_stats = (stats_t *)malloc(sizeof(stats_t) * (size_t)rows);
        if (!row_stats) return -1;
    }
    int64_t most = rows / ROWS_PER_THREAD;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (most < nt) nt = most < 1 ? 1 : (int)most;
    uint64_t acc = 0;
#pragma omp parallel for num_threads(nt) reduction(+ : acc) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++)
        acc += run_row(&b, r, b.do_stats ? &row_stats[rows > 1 ? r : 0] : NULL);
    *hash_out = fmix(acc ^ key);
    if (stats_out) {
        stats_t st = {INFINITY, -INFINITY, 0.0, 0.0, 0.0, 0.0};
        for (int64_t r = 0; b.do_stats && r < rows; r++) {
            const stats_t *rs = &row_stats[r];
            if (rs->mn < st.mn) st.mn = rs->mn;
            if (rs->mx > st.mx) st.mx = rs->mx;
            st.sum += rs->sum;
            st.sq += rs->sq;
            st.nan += rs->nan;
            st.inf += rs->inf;
        }
        if (st.nan > 0) { st.mn = NAN; st.mx = NAN; }
        stats_out[0] = st.mn;
        stats_out[1] = st.mx;
        stats_out[2] = st.sum;
        stats_out[3] = st.sq;
        stats_out[4] = st.nan;
        stats_out[5] = st.inf;
    }
    if (row_stats != &one) free(row_stats);
    return 0;
}
