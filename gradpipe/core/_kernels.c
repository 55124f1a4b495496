/* Per-element loops of the chunk pipeline, compiled, run without the GIL.
 *
 * Each function is one pass over a chunk that numpy makes in several, and none holds the
 * GIL while it loops: byte planes split (with the sign moved below the exponent) and
 * joined back (with the sign restored), and the float statistics of a chunk. The pure numpy
 * versions in gradpipe/codecs/_planes.py and gradpipe/core/chunk_stats.py stay the
 * reference: gradpipe.core.kernels falls back to them when this module was not built, and
 * the tests hold the two to the same results.
 *
 * Buffers are taken through the buffer protocol (C-contiguous; the caller passes bytes of
 * little-endian words, as gradpipe stores them); nothing here allocates per element.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* No fused multiply-adds anywhere (setup.py passes -ffp-contract=off to GCC): sums of squares
 * must round the same on every machine. */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

#if PY_BIG_ENDIAN
#error "gradpipe's kernels read little-endian words in native order"
#endif

/* Wider vectors where the CPU has them: GCC compiles each loop below for AVX2 and AVX-512 as
 * well as the baseline, and glibc's loader picks one for the machine it runs on (ifunc), so a
 * build made on one x86-64 machine runs on any. (GCC 12 is the first to take arch= levels
 * here; older compilers build the baseline only.) */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && \
    defined(__GLIBC__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* --- byte planes ------------------------------------------------------------------------ */

/* split(src, dst, width, move_sign): dst (width * count bytes) gets row k = byte k of every
 * word of src (count words of width bytes). With move_sign (width 2 or 4: bfloat16 and
 * float32), the top row holds the 8 exponent bits and the row below it the sign in bit 7
 * above its 7 mantissa bits, as _planes.move_sign_split leaves them. */
static void split_any(const uint8_t *src, uint8_t *dst, Py_ssize_t count, int width) {
    for (int k = 0; k < width; k++) {
        uint8_t *row = dst + (Py_ssize_t)k * count;
        const uint8_t *from = src + k;
        for (Py_ssize_t i = 0; i < count; i++) row[i] = from[i * width];
    }
}

VECTOR_CLONES static void split4(const uint8_t *src, uint8_t *dst, Py_ssize_t count, int move_sign) {
    uint8_t *p0 = dst, *p1 = dst + count, *p2 = dst + 2 * count, *p3 = dst + 3 * count;
    if (move_sign) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t w;
            memcpy(&w, src + 4 * i, 4);
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
            p2[i] = (uint8_t)(((w >> 16) & 0x7F) | ((w >> 24) & 0x80));
            p3[i] = (uint8_t)(w >> 23);
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t w;
            memcpy(&w, src + 4 * i, 4);
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
            p2[i] = (uint8_t)(w >> 16);
            p3[i] = (uint8_t)(w >> 24);
        }
    }
}

VECTOR_CLONES static void split2(const uint8_t *src, uint8_t *dst, Py_ssize_t count, int move_sign) {
    uint8_t *p0 = dst, *p1 = dst + count;
    if (move_sign) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t w;
            memcpy(&w, src + 2 * i, 2);
            p0[i] = (uint8_t)((w & 0x7F) | ((w >> 8) & 0x80));
            p1[i] = (uint8_t)(w >> 7);
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t w;
            memcpy(&w, src + 2 * i, 2);
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
        }
    }
}

VECTOR_CLONES static void split8(const uint8_t *src, uint8_t *dst, Py_ssize_t count) {
    uint8_t *p[8];
    for (int k = 0; k < 8; k++) p[k] = dst + (Py_ssize_t)k * count;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t w;
        memcpy(&w, src + 8 * i, 8);
        for (int k = 0; k < 8; k++) p[k][i] = (uint8_t)(w >> (8 * k));
    }
}

/* join(planes, dst, width, sign_moved): the inverse of split. */
VECTOR_CLONES static void join4(const uint8_t *const *p, uint8_t *dst, Py_ssize_t count, int sign_moved) {
    const uint8_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    if (sign_moved) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t e = p3[i], r = p2[i];
            uint32_t high = (e >> 1) | (r & 0x80);
            uint32_t low = ((e << 7) & 0x80) | (r & 0x7F);
            uint32_t w = p0[i] | ((uint32_t)p1[i] << 8) | (low << 16) | (high << 24);
            memcpy(dst + 4 * i, &w, 4);
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t w = p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) |
                         ((uint32_t)p3[i] << 24);
            memcpy(dst + 4 * i, &w, 4);
        }
    }
}

VECTOR_CLONES static void join2(const uint8_t *const *p, uint8_t *dst, Py_ssize_t count, int sign_moved) {
    const uint8_t *p0 = p[0], *p1 = p[1];
    if (sign_moved) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t e = p1[i], r = p0[i];
            uint16_t high = (uint16_t)((e >> 1) | (r & 0x80));
            uint16_t low = (uint16_t)(((e << 7) & 0x80) | (r & 0x7F));
            uint16_t w = (uint16_t)(low | (high << 8));
            memcpy(dst + 2 * i, &w, 2);
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t w = (uint16_t)(p0[i] | (p1[i] << 8));
            memcpy(dst + 2 * i, &w, 2);
        }
    }
}

static void join_any(const uint8_t *const *p, uint8_t *dst, Py_ssize_t count, int width) {
    for (int k = 0; k < width; k++) {
        const uint8_t *row = p[k];
        uint8_t *to = dst + k;
        for (Py_ssize_t i = 0; i < count; i++) to[i * width] = row[i];
    }
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a %scontiguous buffer", what,
                     writable ? "writable " : "");
        return -1;
    }
    return 0;
}

static int check_width(int width, int sign) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, not %d", width);
        return -1;
    }
    if (sign && width != 2 && width != 4) {
        PyErr_SetString(PyExc_ValueError, "the sign moves only in 2- and 4-byte words");
        return -1;
    }
    return 0;
}

static PyObject *kernels_split(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_obj, *dst_obj;
    int width, move_sign;
    if (!PyArg_ParseTuple(args, "OOip:split", &src_obj, &dst_obj, &width, &move_sign))
        return NULL;
    if (check_width(width, move_sign) < 0) return NULL;
    Py_buffer src, dst;
    if (get_buffer(src_obj, &src, 0, "src") < 0) return NULL;
    if (get_buffer(dst_obj, &dst, 1, "dst") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (src.len != dst.len || src.len % width) {
        PyErr_Format(PyExc_ValueError,
                     "split: src (%zd bytes) and dst (%zd bytes) must be the same whole "
                     "number of %d-byte words",
                     src.len, dst.len, width);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    const uint8_t *s = src.buf;
    uint8_t *d = dst.buf;
    Py_ssize_t count = src.len / width;
    Py_BEGIN_ALLOW_THREADS
    if (width == 4)
        split4(s, d, count, move_sign);
    else if (width == 2)
        split2(s, d, count, move_sign);
    else if (width == 8)
        split8(s, d, count);
    else
        split_any(s, d, count, width);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyObject *kernels_join(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *planes_obj, *dst_obj;
    int sign_moved;
    if (!PyArg_ParseTuple(args, "OOp:join", &planes_obj, &dst_obj, &sign_moved)) return NULL;
    /* A tuple of its own: a plane's buffer export cannot change the sequence under us. */
    PyObject *seq = PySequence_Tuple(planes_obj);
    if (seq == NULL) return NULL;
    Py_ssize_t width = PyTuple_GET_SIZE(seq);
    if (width > 8 || check_width((int)width, sign_moved) < 0) {
        if (width > 8) PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, not %zd", width);
        Py_DECREF(seq);
        return NULL;
    }
    Py_buffer views[8], dst;
    const uint8_t *rows[8];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (get_buffer(dst_obj, &dst, 1, "dst") < 0) goto done_seq;
    if (dst.len % width) {
        PyErr_Format(PyExc_ValueError, "join: dst (%zd bytes) is not whole %zd-byte words",
                     dst.len, width);
        goto done;
    }
    Py_ssize_t count = dst.len / width;
    for (; held < width; held++) {
        if (get_buffer(PyTuple_GET_ITEM(seq, held), &views[held], 0, "a plane") < 0)
            goto done;
        if (views[held].len != count) {
            PyErr_Format(PyExc_ValueError, "join: plane %zd holds %zd bytes, not %zd", held,
                         views[held].len, count);
            held++;
            goto done;
        }
        rows[held] = views[held].buf;
    }
    uint8_t *d = dst.buf;
    Py_BEGIN_ALLOW_THREADS
    if (width == 4)
        join4(rows, d, count, sign_moved);
    else if (width == 2)
        join2(rows, d, count, sign_moved);
    else
        join_any(rows, d, count, (int)width);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    PyBuffer_Release(&dst);
done_seq:
    Py_DECREF(seq);
    return result;
}

/* --- float statistics ------------------------------------------------------------------- */

/* Sums of a chunk in blocks of 128 values (8 running sums each, so the loop pipelines), the
 * blocks' sums added pairwise (a binary counter of partial sums): numpy's pairwise summation,
 * whose rounding error grows with log(n), not n. The last bits differ from numpy's. */
#define BLOCK 128
#define LANES 8

typedef struct {
    double partial[64]; /* partial[k]: the sum of 2**k blocks, or 0 */
    uint64_t blocks;
} pairwise;

static void pairwise_add(pairwise *p, double block_sum) {
    int k = 0;
    uint64_t n = p->blocks++;
    while (n & 1) { /* carry: merge equal-sized partial sums */
        block_sum += p->partial[k];
        p->partial[k] = 0.0;
        n >>= 1;
        k++;
    }
    p->partial[k] = block_sum;
}

static double pairwise_total(const pairwise *p) {
    double total = 0.0;
    for (int k = 0; k < 64; k++) total += p->partial[k];
    return total;
}

typedef struct {
    int64_t bits_nonzero, negative_zeros, nan, inf;
    double min, max, sum, sumsq;
} float_stats;

/* A block's lane sums, added in lane order, into the chunk's pairwise sums. */
static inline void add_block(pairwise *sums, pairwise *sumsqs, const double *s, const double *q) {
    double block = 0.0, block_sq = 0.0;
    for (int l = 0; l < LANES; l++) {
        block += s[l];
        block_sq += q[l];
    }
    pairwise_add(sums, block);
    pairwise_add(sumsqs, block_sq);
}

/* The record of a chunk from its counts, range and sums. */
static void finish_stats(float_stats *out, Py_ssize_t count, int64_t nonzero,
                         int64_t negative_zeros, int64_t nan, int64_t inf, double lo, double hi,
                         const pairwise *sums, const pairwise *sumsqs) {
    if (count - nonzero + negative_zeros > 0) { /* zeros (+0 and -0) count towards the range */
        if (lo > 0.0) lo = 0.0;
        if (hi < 0.0) hi = 0.0;
    }
    /* -0.0 and 0.0 are one number: the record must not depend on which one was seen. */
    if (lo == 0.0) lo = 0.0;
    if (hi == 0.0) hi = 0.0;
    out->bits_nonzero = nonzero;
    out->negative_zeros = negative_zeros;
    out->nan = nan;
    out->inf = inf;
    out->min = lo;
    out->max = hi;
    out->sum = pairwise_total(sums);
    out->sumsq = pairwise_total(sumsqs);
}

static inline double f32_value(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline double f64_value(uint64_t bits) {
    double f;
    memcpy(&f, &bits, 8);
    return f;
}

static inline double bf16_value(uint16_t bits) { return f32_value((uint32_t)bits << 16); }

static inline double f16_value(uint16_t h) { /* finite values only */
    int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    double magnitude = exponent ? ldexp((double)(mantissa | 0x400), exponent - 25)
                                : ldexp((double)mantissa, -24);
    return (h & 0x8000) ? -magnitude : magnitude;
}

/* One pass: the bit patterns that are not zero, negative zeros, NaN and infinities (told by
 * the exponent bits), the range of the values that are not NaN, and the sums over the finite
 * ones. Eight running sums per block of BLOCK values, fixed in order. */
#define DEFINE_STATS(NAME, TYPE, SIGN, EXPONENT, MANTISSA, VALUE)                             \
    static void NAME(const TYPE *w, Py_ssize_t count, float_stats *out) {                     \
        pairwise sums, sumsqs;                                                                \
        memset(&sums, 0, sizeof sums);                                                        \
        memset(&sumsqs, 0, sizeof sumsqs);                                                    \
        int64_t nonzero = 0, negative_zeros = 0, nan = 0, inf = 0;                            \
        double lo = INFINITY, hi = -INFINITY;                                                 \
        for (Py_ssize_t start = 0; start < count; start += BLOCK) {                           \
            Py_ssize_t stop = start + BLOCK < count ? start + BLOCK : count;                  \
            double s[LANES] = {0}, q[LANES] = {0};                                            \
            Py_ssize_t i = start;                                                             \
            for (; i + LANES <= stop; i += LANES)                                             \
                for (int l = 0; l < LANES; l++) STEP(TYPE, SIGN, EXPONENT, MANTISSA, VALUE, w[i + l], l); \
            for (; i < stop; i++) STEP(TYPE, SIGN, EXPONENT, MANTISSA, VALUE, w[i], 0);           \
            add_block(&sums, &sumsqs, s, q);                                                  \
        }                                                                                     \
        finish_stats(out, count, nonzero, negative_zeros, nan, inf, lo, hi, &sums, &sumsqs);   \
    }

#define STEP(TYPE, SIGN, EXPONENT, MANTISSA, VALUE, BITS, L)                                  \
    do {                                                                                      \
        TYPE bits = (BITS);                                                                   \
        if (bits == 0) break;                                                                 \
        nonzero++;                                                                            \
        if (bits == (TYPE)(SIGN)) {                                                           \
            negative_zeros++;                                                                 \
            break;                                                                            \
        }                                                                                     \
        if ((bits & (TYPE)(EXPONENT)) == (TYPE)(EXPONENT)) {                                  \
            if (bits & (TYPE)(MANTISSA)) {                                                    \
                nan++;                                                                        \
            } else {                                                                          \
                inf++;                                                                        \
                if (bits & (TYPE)(SIGN))                                                      \
                    lo = -INFINITY;                                                           \
                else                                                                          \
                    hi = INFINITY;                                                            \
            }                                                                                 \
            break;                                                                            \
        }                                                                                     \
        double v = VALUE(bits);                                                               \
        lo = v < lo ? v : lo;                                                                 \
        hi = v > hi ? v : hi;                                                                 \
        s[L] += v;                                                                            \
        q[L] += v * v;                                                                        \
    } while (0)

/* A block of BLOCK float32 (or bfloat16) values with no infinity or NaN, with no branch: lane
 * l sums the values l, l + LANES, ... in order, and the lanes are added in a fixed order, so
 * the sums are the same bits whatever vector width the compiler picks (and fused
 * multiply-adds are off for the same reason). GCC vectorises the lanes only when told there
 * are no NaN and no signed zeros to keep apart in the range, true of these blocks. */
#if defined(__GNUC__) && !defined(__clang__)
#define CLEAN_MATH                                                                            \
    __attribute__((optimize("O3", "no-signed-zeros", "no-trapping-math", "finite-math-only",  \
                            "fp-contract=off")))
#else
#define CLEAN_MATH
#endif

#define DEFINE_CLEAN_BLOCK(NAME, TYPE, LOAD)                                                  \
    CLEAN_MATH VECTOR_CLONES static void NAME(const TYPE *w, double *s, double *q,            \
                                              float *lo, float *hi, int64_t *nonzero,         \
                                              int64_t *negative_zeros) {                      \
        int32_t block_nonzero = 0, block_negative = 0;                                        \
        double ls[LANES] = {0}, lq[LANES] = {0};                                              \
        float flo[LANES], fhi[LANES]; /* finite-math-only: no infinities here */              \
        for (int l = 0; l < LANES; l++) flo[l] = FLT_MAX, fhi[l] = -FLT_MAX;                  \
        for (int i = 0; i < BLOCK; i += LANES)                                                \
            for (int l = 0; l < LANES; l++) {                                                 \
                uint32_t bits = LOAD(w[i + l]);                                               \
                float f;                                                                      \
                memcpy(&f, &bits, 4);                                                         \
                block_nonzero += bits != 0;                                                   \
                block_negative += bits == 0x80000000u;                                        \
                flo[l] = f < flo[l] ? f : flo[l];                                             \
                fhi[l] = f > fhi[l] ? f : fhi[l];                                             \
                double v = f;                                                                 \
                ls[l] += v;                                                                   \
                lq[l] += v * v;                                                               \
            }                                                                                 \
        for (int l = 0; l < LANES; l++) {                                                     \
            s[l] += ls[l];                                                                    \
            q[l] += lq[l];                                                                    \
        }                                                                                     \
        *nonzero += block_nonzero;                                                            \
        *negative_zeros += block_negative;                                                    \
        *lo = flo[0];                                                                         \
        *hi = fhi[0];                                                                         \
        for (int l = 1; l < LANES; l++) {                                                     \
            *lo = flo[l] < *lo ? flo[l] : *lo;                                                \
            *hi = fhi[l] > *hi ? fhi[l] : *hi;                                                \
        }                                                                                     \
    }

/* float32 and bfloat16 (a float32 with its low 16 bits zero), the common case made fast: a
 * block without infinities or NaN (told by an integer pass over it, in L1 cache) is summed
 * with no branch per value, which the compiler vectorises; a block with any goes through
 * STEP, value by value. */
#define DEFINE_STATS32(NAME, TYPE, LOAD)                                                      \
    static void NAME(const TYPE *w, Py_ssize_t count, float_stats *out) {                     \
        pairwise sums, sumsqs;                                                                \
        memset(&sums, 0, sizeof sums);                                                        \
        memset(&sumsqs, 0, sizeof sumsqs);                                                    \
        int64_t nonzero = 0, negative_zeros = 0, nan = 0, inf = 0;                            \
        double lo = INFINITY, hi = -INFINITY;                                                 \
        for (Py_ssize_t start = 0; start < count; start += BLOCK) {                           \
            Py_ssize_t stop = start + BLOCK < count ? start + BLOCK : count;                  \
            double s[LANES] = {0}, q[LANES] = {0};                                            \
            uint32_t special = 0;                                                             \
            for (Py_ssize_t i = start; i < stop; i++)                                         \
                special |= (LOAD(w[i]) & 0x7F800000u) == 0x7F800000u;                         \
            if (special || stop - start != BLOCK) {                                           \
                for (Py_ssize_t i = start; i < stop; i++)                                     \
                    STEP(uint32_t, 0x80000000u, 0x7F800000u, 0x007FFFFFu, f32_value, LOAD(w[i]), 0); \
            } else {                                                                          \
                float block_lo, block_hi;                                                     \
                clean_block_##NAME(w + start, s, q, &block_lo, &block_hi, &nonzero,            \
                                   &negative_zeros);                                          \
                if (block_lo < lo) lo = block_lo;                                             \
                if (block_hi > hi) hi = block_hi;                                             \
            }                                                                                 \
            add_block(&sums, &sumsqs, s, q);                                                  \
        }                                                                                     \
        finish_stats(out, count, nonzero, negative_zeros, nan, inf, lo, hi, &sums, &sumsqs);   \
    }

#define LOAD_F32(x) ((uint32_t)(x))
#define LOAD_BF16(x) ((uint32_t)(x) << 16)

DEFINE_CLEAN_BLOCK(clean_block_stats_f32, uint32_t, LOAD_F32)
DEFINE_STATS32(stats_f32, uint32_t, LOAD_F32)
DEFINE_STATS(stats_f64, uint64_t, 0x8000000000000000ull, 0x7FF0000000000000ull,
             0x000FFFFFFFFFFFFFull, f64_value)
DEFINE_CLEAN_BLOCK(clean_block_stats_bf16, uint16_t, LOAD_BF16)
DEFINE_STATS32(stats_bf16, uint16_t, LOAD_BF16)
DEFINE_STATS(stats_f16, uint16_t, 0x8000u, 0x7C00u, 0x03FFu, f16_value)

static PyObject *kernels_float_stats(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    int kind;
    if (!PyArg_ParseTuple(args, "OC:float_stats", &obj, &kind)) return NULL;
    int width = kind == 'f' ? 4 : kind == 'd' ? 8 : (kind == 'b' || kind == 'e') ? 2 : 0;
    if (width == 0) {
        PyErr_Format(PyExc_ValueError, "float_stats: unknown kind %c", kind);
        return NULL;
    }
    Py_buffer view;
    if (get_buffer(obj, &view, 0, "data") < 0) return NULL;
    if (view.len % width) {
        PyErr_Format(PyExc_ValueError, "float_stats: %zd bytes are not whole %d-byte values",
                     view.len, width);
        PyBuffer_Release(&view);
        return NULL;
    }
    float_stats s;
    Py_ssize_t count = view.len / width;
    /* Aligned reads: a view that starts mid-word is copied (it never is in gradpipe). */
    void *data = view.buf, *copy = NULL;
    if ((uintptr_t)data % width) {
        copy = PyMem_RawMalloc(view.len ? view.len : 1);
        if (copy == NULL) {
            PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        memcpy(copy, data, view.len);
        data = copy;
    }
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        stats_f32(data, count, &s);
    else if (kind == 'd')
        stats_f64(data, count, &s);
    else if (kind == 'b')
        stats_bf16(data, count, &s);
    else
        stats_f16(data, count, &s);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(copy);
    PyBuffer_Release(&view);
    if (s.nan == count) /* nothing but NaN: no range */
        return Py_BuildValue("LLLLOOdd", s.bits_nonzero, s.negative_zeros, s.nan, s.inf,
                             Py_None, Py_None, s.sum, s.sumsq);
    return Py_BuildValue("LLLLdddd", s.bits_nonzero, s.negative_zeros, s.nan, s.inf, s.min,
                         s.max, s.sum, s.sumsq);
}

/* --- the weighted-sum forest of aggregation ------------------------------------------- */

/* forest(ops, inputs, kinds, size, buffers, results, finals, finish, check): the program that
 * gradpipe/aggregation/kernel.py plans (Program), run over every block of the chunk here
 * instead of as numpy calls per block. The operations and their order are the program's, so
 * every element sees the same float64 operations as there: a term fl64(c * x) (times
 * 2**e with ldexp), a sibling sum a + b, a copy; then, to finish, the left-to-right fold of
 * the result blocks, the division, the ldexp, the noise and the one rounding.
 *
 * Operands are ints: b >= 0 is buffer b, -(k + 1) is input k. Inputs are flat float32 ('f')
 * or float64 ('d') arrays; only a term reads a float32 one (kernel.py checks). results: per
 * result block, a float64 array of the chunk to fill (partials), or None. finish: None, or
 * (out, 'f' or 'd', divisor or None, exponent, noise or None).
 *
 * Returns None, or the first element of a block that held NaN or infinity (or, finishing, did
 * not fit the output): the caller then runs its numpy version, which raises the same error
 * it always has. */

#define FOREST_BLOCK 2048
#define FOREST_TERM 0
#define FOREST_COPY 1
#define FOREST_ADD 2

typedef struct {
    int code, out, a, b, exponent;
    double coefficient;
} forest_op;

typedef struct {
    const void *data;
    char kind; /* 'f' or 'd' */
} forest_input;

typedef struct {
    Py_ssize_t size;
    int nops, ninputs, nbuffers, nresults, nfinals, check, finishing;
    const forest_op *ops;
    const forest_input *inputs;
    double **results; /* nresults entries, NULL where a result block is an input */
    const int *finals;
    double *scratch;  /* (nbuffers + 1) blocks; the last is the fold's accumulator */
    void *out;
    char out_kind;
    int has_divisor, out_exponent;
    double divisor;
    const double *noise;
} forest_program;

static double *forest_buffer(const forest_program *p, int b, Py_ssize_t start) {
    if (b < p->nresults && p->results[b] != NULL) return p->results[b] + start;
    return p->scratch + (Py_ssize_t)b * FOREST_BLOCK;
}

/* A float64 operand (buffer, or a float64 input) of one block. */
static const double *forest_doubles(const forest_program *p, int operand, Py_ssize_t start) {
    if (operand >= 0) return forest_buffer(p, operand, start);
    return (const double *)p->inputs[-operand - 1].data + start;
}

VECTOR_CLONES static void forest_term_f(double *t, const float *x, double c, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) t[i] = (double)x[i] * c;
}

VECTOR_CLONES static void forest_term_d(double *t, const double *x, double c, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) t[i] = x[i] * c;
}

VECTOR_CLONES static void forest_add(double *t, const double *a, const double *b, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) t[i] = a[i] + b[i];
}

static void forest_ldexp(double *t, const double *a, int exponent, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) t[i] = ldexp(a[i], exponent);
}

/* Whether every value is finite (exponent bits not all ones). */
VECTOR_CLONES static int forest_finite(const double *a, Py_ssize_t n) {
    uint64_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t w;
        memcpy(&w, a + i, 8);
        bad |= (~w & 0x7FF0000000000000ull) == 0;
    }
    return !bad;
}

/* out = (float)a, and whether every rounded value is finite. */
VECTOR_CLONES static int forest_round_f(float *out, const double *a, Py_ssize_t n) {
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        float v = (float)a[i];
        uint32_t w;
        memcpy(&w, &v, 4);
        bad |= (~w & 0x7F800000u) == 0;
        out[i] = v;
    }
    return !bad;
}

static void forest_block(const forest_program *p, Py_ssize_t start, Py_ssize_t n) {
    for (int j = 0; j < p->nops; j++) {
        const forest_op *op = &p->ops[j];
        double *target = forest_buffer(p, op->out, start);
        if (op->code == FOREST_ADD) {
            forest_add(target, forest_doubles(p, op->a, start), forest_doubles(p, op->b, start), n);
            continue;
        }
        const forest_input *in = &p->inputs[-op->a - 1];
        double c = op->code == FOREST_TERM ? op->coefficient : 1.0;
        if (in->kind == 'f')
            forest_term_f(target, (const float *)in->data + start, c, n);
        else if (op->code == FOREST_TERM)
            forest_term_d(target, (const double *)in->data + start, c, n);
        else
            memcpy(target, (const double *)in->data + start, (size_t)n * 8);
        if (op->code == FOREST_TERM && op->exponent) forest_ldexp(target, target, op->exponent, n);
    }
}

/* Fold, divide, scale, add the noise and round one block; 0 where it must be refused. */
static int forest_finish_block(const forest_program *p, Py_ssize_t start, Py_ssize_t n) {
    double *acc = p->scratch + (Py_ssize_t)p->nbuffers * FOREST_BLOCK;
    const double *total = forest_doubles(p, p->finals[0], start);
    if (p->nfinals > 1) {
        forest_add(acc, total, forest_doubles(p, p->finals[1], start), n);
        for (int j = 2; j < p->nfinals; j++)
            forest_add(acc, acc, forest_doubles(p, p->finals[j], start), n);
        total = acc;
    }
    if (p->check && !forest_finite(total, n)) return 0;
    if (p->has_divisor) {
        for (Py_ssize_t i = 0; i < n; i++) acc[i] = total[i] / p->divisor;
        total = acc;
    }
    if (p->out_exponent) {
        forest_ldexp(acc, total, p->out_exponent, n);
        total = acc;
    }
    if (p->noise != NULL) {
        forest_add(acc, total, p->noise + start, n);
        total = acc;
    }
    if (p->out_kind == 'f') return forest_round_f((float *)p->out + start, total, n);
    memcpy((double *)p->out + start, total, (size_t)n * 8);
    return forest_finite(total, n);
}

/* The first element of the block that failed, or -1. */
static Py_ssize_t forest_run(const forest_program *p) {
    for (Py_ssize_t start = 0; start < p->size; start += FOREST_BLOCK) {
        Py_ssize_t n = p->size - start < FOREST_BLOCK ? p->size - start : FOREST_BLOCK;
        forest_block(p, start, n);
        if (p->finishing) {
            if (!forest_finish_block(p, start, n)) return start;
        } else if (p->check) {
            for (int j = 0; j < p->nfinals; j++)
                if (p->finals[j] >= 0 && !forest_finite(forest_buffer(p, p->finals[j], start), n))
                    return start;
        }
    }
    return -1;
}

/* Views held while the program runs: released in one place. */
typedef struct {
    Py_buffer *views;
    int count;
} forest_views;

/* A view of size values of kind ('f' float32, 'd' float64), contiguous, in native order. */
static int forest_view(forest_views *held, PyObject *obj, Py_ssize_t size, char kind,
                       int writable, const char *what) {
    Py_buffer *view = &held->views[held->count];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "forest: %s must be a %scontiguous buffer", what,
                     writable ? "writable " : "");
        return -1;
    }
    held->count++;
    const char *format = view->format ? view->format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    Py_ssize_t width = kind == 'f' ? 4 : 8;
    if (format[0] != kind || format[1] != '\0' || view->itemsize != width) {
        PyErr_Format(PyExc_ValueError, "forest: %s holds '%s' values, not '%c'", what,
                     view->format ? view->format : "B", kind);
        return -1;
    }
    if (view->len != size * width) {
        PyErr_Format(PyExc_ValueError, "forest: %s holds %zd bytes, not %zd", what, view->len,
                     size * width);
        return -1;
    }
    if ((uintptr_t)view->buf % width) {
        PyErr_Format(PyExc_ValueError, "forest: %s is not aligned", what);
        return -1;
    }
    return 0;
}

/* A Python int in [low, high], else a ValueError (or the conversion's error). */
static int forest_int(PyObject *item, long low, long high, const char *what, long *value) {
    *value = PyLong_AsLong(item);
    if (*value == -1 && PyErr_Occurred()) return -1;
    if (*value < low || *value > high) {
        PyErr_Format(PyExc_ValueError, "forest: %s %ld out of range", what, *value);
        return -1;
    }
    return 0;
}

static int forest_operand(PyObject *item, int ninputs, int nbuffers, int *operand) {
    long value = PyLong_AsLong(item);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value >= nbuffers || value < -(long)ninputs) {
        PyErr_Format(PyExc_ValueError, "forest: operand %ld out of range", value);
        return -1;
    }
    *operand = (int)value;
    return 0;
}

static PyObject *kernels_forest(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ops_obj, *inputs_obj, *kinds_obj, *results_obj, *finals_obj, *finish_obj;
    Py_ssize_t size;
    int nbuffers, check;
    if (!PyArg_ParseTuple(args, "O!O!UniO!O!Op:forest", &PyTuple_Type, &ops_obj, &PyTuple_Type,
                          &inputs_obj, &kinds_obj, &size, &nbuffers, &PyTuple_Type,
                          &results_obj, &PyTuple_Type, &finals_obj, &finish_obj, &check))
        return NULL;
    forest_program p = {0};
    p.size = size;
    p.nops = (int)PyTuple_GET_SIZE(ops_obj);
    p.ninputs = (int)PyTuple_GET_SIZE(inputs_obj);
    p.nbuffers = nbuffers;
    p.nresults = (int)PyTuple_GET_SIZE(results_obj);
    p.nfinals = (int)PyTuple_GET_SIZE(finals_obj);
    p.check = check;
    p.finishing = finish_obj != Py_None;
    if (size < 0 || size > PY_SSIZE_T_MAX / 8 || nbuffers < p.nresults || nbuffers > (1 << 16) ||
        p.nfinals < 1 || PyUnicode_GET_LENGTH(kinds_obj) != p.ninputs ||
        (finish_obj != Py_None && !PyTuple_Check(finish_obj))) {
        PyErr_SetString(PyExc_ValueError, "forest: inconsistent program");
        return NULL;
    }
    forest_op *ops = PyMem_Calloc(p.nops + 1, sizeof(forest_op));
    forest_input *inputs = PyMem_Calloc(p.ninputs + 1, sizeof(forest_input));
    double **results = PyMem_Calloc(p.nresults + 1, sizeof(double *));
    int *finals = PyMem_Calloc(p.nfinals, sizeof(int));
    forest_views held = {PyMem_Calloc(p.ninputs + p.nresults + 2, sizeof(Py_buffer)), 0};
    double *scratch = NULL;
    PyObject *answer = NULL;
    if (!ops || !inputs || !results || !finals || !held.views) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < p.ninputs; k++) {
        Py_UCS4 kind = PyUnicode_READ_CHAR(kinds_obj, k);
        if (kind != 'f' && kind != 'd') {
            PyErr_SetString(PyExc_ValueError, "forest: inputs are 'f' or 'd'");
            goto done;
        }
        inputs[k].kind = (char)kind;
        if (forest_view(&held, PyTuple_GET_ITEM(inputs_obj, k), size, (char)kind, 0,
                        "an input") < 0)
            goto done;
        inputs[k].data = held.views[held.count - 1].buf;
    }
    for (int j = 0; j < p.nops; j++) {
        PyObject *op = PyTuple_GET_ITEM(ops_obj, j);
        forest_op *o = &ops[j];
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 6) {
            PyErr_SetString(PyExc_ValueError, "forest: an op is (code, out, a, b, c, e)");
            goto done;
        }
        long code, exponent;
        if (forest_int(PyTuple_GET_ITEM(op, 0), FOREST_TERM, FOREST_ADD, "op code", &code) < 0 ||
            forest_int(PyTuple_GET_ITEM(op, 5), -100000, 100000, "exponent", &exponent) < 0)
            goto done;
        o->code = (int)code;
        o->exponent = (int)exponent;
        o->coefficient = PyFloat_AsDouble(PyTuple_GET_ITEM(op, 4));
        if ((o->coefficient == -1.0 && PyErr_Occurred()) ||
            forest_operand(PyTuple_GET_ITEM(op, 1), 0, nbuffers, &o->out) < 0 ||
            forest_operand(PyTuple_GET_ITEM(op, 2), p.ninputs, nbuffers, &o->a) < 0 ||
            forest_operand(PyTuple_GET_ITEM(op, 3), p.ninputs, nbuffers, &o->b) < 0)
            goto done;
        int term_or_copy = o->code == FOREST_TERM || o->code == FOREST_COPY;
        if ((o->code != FOREST_ADD && !term_or_copy) || (term_or_copy && o->a >= 0) ||
            (o->code == FOREST_COPY && inputs[-o->a - 1].kind != 'd') ||
            (o->code == FOREST_ADD && ((o->a < 0 && inputs[-o->a - 1].kind != 'd') ||
                                       (o->b < 0 && inputs[-o->b - 1].kind != 'd')))) {
            PyErr_SetString(PyExc_ValueError, "forest: an op reads what it cannot");
            goto done;
        }
    }
    for (int j = 0; j < p.nfinals; j++) {
        if (forest_operand(PyTuple_GET_ITEM(finals_obj, j), p.ninputs, nbuffers, &finals[j]) < 0)
            goto done;
        if (finals[j] < 0 && inputs[-finals[j] - 1].kind != 'd') {
            PyErr_SetString(PyExc_ValueError, "forest: a result block is float64");
            goto done;
        }
    }
    for (int b = 0; b < p.nresults; b++) {
        PyObject *array = PyTuple_GET_ITEM(results_obj, b);
        if (array == Py_None) continue;
        if (forest_view(&held, array, size, 'd', 1, "a result") < 0) goto done;
        results[b] = held.views[held.count - 1].buf;
    }
    if (p.finishing) {
        PyObject *out_obj, *divisor_obj, *noise_obj;
        int out_kind;
        if (!PyArg_ParseTuple(finish_obj, "OCOiO:forest finish", &out_obj, &out_kind,
                              &divisor_obj, &p.out_exponent, &noise_obj))
            goto done;
        if (out_kind != 'f' && out_kind != 'd') {
            PyErr_SetString(PyExc_ValueError, "forest: the output is 'f' or 'd'");
            goto done;
        }
        p.out_kind = (char)out_kind;
        if (forest_view(&held, out_obj, size, (char)out_kind, 1, "the output") < 0)
            goto done;
        p.out = held.views[held.count - 1].buf;
        p.has_divisor = divisor_obj != Py_None;
        if (p.has_divisor) {
            p.divisor = PyFloat_AsDouble(divisor_obj);
            if (p.divisor == -1.0 && PyErr_Occurred()) goto done;
        }
        if (noise_obj != Py_None) {
            if (forest_view(&held, noise_obj, size, 'd', 0, "the noise") < 0) goto done;
            p.noise = held.views[held.count - 1].buf;
        }
    }
    scratch = PyMem_RawMalloc((size_t)(nbuffers + 1) * FOREST_BLOCK * sizeof(double));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    p.ops = ops;
    p.inputs = inputs;
    p.results = results;
    p.finals = finals;
    p.scratch = scratch;
    Py_ssize_t failed;
    Py_BEGIN_ALLOW_THREADS
    failed = forest_run(&p);
    Py_END_ALLOW_THREADS
    answer = failed < 0 ? Py_NewRef(Py_None) : PyLong_FromSsize_t(failed);
done:
    for (int k = 0; k < held.count; k++) PyBuffer_Release(&held.views[k]);
    PyMem_RawFree(scratch);
    PyMem_Free(held.views);
    PyMem_Free(finals);
    PyMem_Free(results);
    PyMem_Free(inputs);
    PyMem_Free(ops);
    return answer;
}

static PyMethodDef methods[] = {
    {"split", kernels_split, METH_VARARGS,
     "split(src, dst, width, move_sign): byte planes of src's words into dst, without the GIL."},
    {"join", kernels_join, METH_VARARGS,
     "join(planes, dst, sign_moved): the words of byte planes into dst, without the GIL."},
    {"float_stats", kernels_float_stats, METH_VARARGS,
     "float_stats(data, kind): (bits_nonzero, negative_zeros, nan, inf, min, max, sum, sumsq)\n"
     "of little-endian floats ('f' float32, 'd' float64, 'b' bfloat16, 'e' float16)."},
    {"forest", kernels_forest, METH_VARARGS,
     "forest(ops, inputs, kinds, size, buffers, results, finals, finish, check): the\n"
     "aggregation kernel's program over every block, without the GIL (see _kernels.c)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "gradpipe's compiled per-element loops (see _kernels.c).",
    0, methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModuleDef_Init(&module); }
