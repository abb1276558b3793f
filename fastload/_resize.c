/* fastload._resize: area (box-filter) downscaling of uint8 HWC images, what OpenCV's
 * INTER_AREA computes when shrinking, in a fraction of its time.
 *
 * Why: RandomResizedCrop shrinks 15-46% of its boxes to 224x224, antialiased like PIL and
 * FFCV. cv2.resize(INTER_AREA) with a non-integer ratio walks a generic float tap list per
 * pixel (200-500 us for a ~250x280 box); INTER_LINEAR takes ~70 us. This module does the same
 * box filter as two separable fixed-point passes, one output row at a time:
 *
 *   vertical:   tmp[x] = sum_k wy[k] * src[sy + k][x]        over the whole row (W*C bytes),
 *               int16 with 7 fractional bits; every output row is a weighted sum of a few
 *               whole input rows, so this vectorises over contiguous bytes (AVX2 vpmaddwd on
 *               pairs of rows);
 *   horizontal: dst[x][c] = sum_k wx[x][k] * tmp[(sx + k)*C + c], one pixel (all channels)
 *               per 128-bit half, two pixels per AVX2 vpmaddwd on pairs of taps.
 *
 * Tap tables are exact: output o covers [o*in, (o+1)*in) and input i covers [i*out,
 * (i+1)*out) in units of 1/out, so the weights are integer overlaps / in, quantised to 14
 * bits by cumulative rounding (they sum to exactly 1<<14). Both passes round to nearest, so
 * the result is within 0.5 + ~0.01*taps of the exact box average, and within 1 of OpenCV's
 * float INTER_AREA (tests/test_resize.py checks it over random sizes).
 *
 * The AVX2 kernels are compiled with __attribute__((target("avx2"))) and chosen at run time
 * with __builtin_cpu_supports, so one build runs on any x86-64; elsewhere (and with
 * simd=False) portable C that gives bit-identical results runs instead.
 *
 * The work runs with the GIL released; only memory owned by the two Py_buffer views and by
 * this call's scratch allocations is touched.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(FASTLOAD_RESIZE_PORTABLE) /* -D...: build as on non-x86 */
#define HAVE_AVX2_KERNELS 1
#include <immintrin.h>
#else
#define HAVE_AVX2_KERNELS 0
#endif

#define WBITS 14 /* weights: fixed point, sum 1 << WBITS */
#define TBITS 7  /* tmp row: 255 << TBITS = 32640 fits int16 (vpmaddwd is signed) */
#define VSHIFT (WBITS - TBITS)
#define HSHIFT (WBITS + TBITS)

/* Per-axis taps: output o reads in[start[o] .. start[o] + count[o]) with weights
 * w[o*kp ...] (kp = max count rounded up to even; unused taps have weight 0). */
typedef struct {
    int32_t *start;
    int32_t *count;
    int16_t *w;
    int kp;
} Taps;

static void taps_free(Taps *t)
{
    PyMem_RawFree(t->start);
    PyMem_RawFree(t->count);
    PyMem_RawFree(t->w);
    t->start = t->count = NULL;
    t->w = NULL;
}

/* Area taps for in -> out (out <= in). Returns 0, or -1 when out of memory. Walks both axes
 * incrementally: 64-bit divisions per tap cost more than the resize of a small image. */
static int taps_build(Taps *t, int64_t in, int64_t out)
{
    int kmax = 0;
    for (int64_t o = 0, i0 = 0, i1 = 0; o < out; o++) {
        /* i0 = floor(o*in/out), i1 = ceil((o+1)*in/out) */
        while ((i0 + 1) * out <= o * in)
            i0++;
        while (i1 * out < (o + 1) * in)
            i1++;
        if (i1 - i0 > kmax)
            kmax = (int)(i1 - i0);
    }
    t->kp = kmax + (kmax & 1);
    t->start = PyMem_RawMalloc((size_t)out * sizeof(int32_t));
    t->count = PyMem_RawMalloc((size_t)out * sizeof(int32_t));
    t->w = PyMem_RawCalloc((size_t)out * (size_t)t->kp, sizeof(int16_t));
    if (t->start == NULL || t->count == NULL || t->w == NULL) {
        taps_free(t);
        return -1;
    }
    /* Weight of input i = its overlap with [lo, hi) / in, quantised by cumulative rounding so
     * each output's weights sum to exactly 1 << WBITS. */
    const double scale = (double)(1 << WBITS) / (double)in;
    for (int64_t o = 0, i0 = 0; o < out; o++) {
        const int64_t lo = o * in, hi = lo + in;
        while ((i0 + 1) * out <= lo)
            i0++;
        int64_t cum = 0;
        int32_t prev = 0;
        int16_t *w = t->w + o * t->kp;
        int64_t i = i0;
        for (; i * out < hi; i++) {
            const int64_t a = i * out > lo ? i * out : lo, b = (i + 1) * out < hi ? (i + 1) * out : hi;
            cum += b - a;
            const int32_t q = cum == in ? (1 << WBITS) : (int32_t)((double)cum * scale + 0.5);
            w[i - i0] = (int16_t)(q - prev);
            prev = q;
        }
        t->start[o] = (int32_t)i0;
        t->count[o] = (int32_t)(i - i0);
    }
    return 0;
}

/* ---- portable kernels (also the reference for the AVX2 ones: identical results) ---- */

static void vpass_c(const uint8_t *const *rows, const int16_t *w, int n, Py_ssize_t len, int32_t *acc,
                    int16_t *out)
{
    /* Tap-outer over an int32 row so compilers vectorise the inner loop. */
    for (Py_ssize_t x = 0; x < len; x++)
        acc[x] = (int32_t)w[0] * rows[0][x];
    for (int k = 1; k < n; k++) {
        const int32_t wk = w[k];
        const uint8_t *r = rows[k];
        for (Py_ssize_t x = 0; x < len; x++)
            acc[x] += wk * r[x];
    }
    for (Py_ssize_t x = 0; x < len; x++)
        out[x] = (int16_t)((acc[x] + (1 << (VSHIFT - 1))) >> VSHIFT);
}

static inline uint8_t clamp_u8(int32_t v)
{
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* Every tap of the (even) tap count, weight 0 or not: the same loop length for each pixel,
 * so the loops over taps and (constant) channels unroll and predict well. */
static inline void hpass_c_impl(const int16_t *tmp, const Taps *tx, int ow, const int C, int x0, uint8_t *out)
{
    const int kp = tx->kp;
    for (int x = x0; x < ow; x++) {
        const int16_t *w = tx->w + (size_t)x * kp;
        const int16_t *p = tmp + (size_t)tx->start[x] * C;
        int32_t a[4] = {1 << (HSHIFT - 1), 1 << (HSHIFT - 1), 1 << (HSHIFT - 1), 1 << (HSHIFT - 1)};
        for (int k = 0; k < kp; k++, p += C)
            for (int c = 0; c < C; c++)
                a[c] += (int32_t)w[k] * p[c];
        for (int c = 0; c < C; c++)
            out[(size_t)x * C + c] = clamp_u8(a[c] >> HSHIFT);
    }
}

static void hpass_c(const int16_t *tmp, const Taps *tx, int ow, int C, int x0, uint8_t *out)
{
    switch (C) {
    case 1: hpass_c_impl(tmp, tx, ow, 1, x0, out); break;
    case 2: hpass_c_impl(tmp, tx, ow, 2, x0, out); break;
    case 3: hpass_c_impl(tmp, tx, ow, 3, x0, out); break;
    default: hpass_c_impl(tmp, tx, ow, 4, x0, out); break;
    }
}

/* ---- AVX2 kernels ---- */
#if HAVE_AVX2_KERNELS

/* Vertical pass over one output row: wpair[j] = w[2j] | w[2j+1] << 16 (an odd last tap is
 * paired with weight 0). vpmaddwd on interleaved int16 (a_i, b_i) gives a_i*w_a + b_i*w_b per
 * int32; the accumulators stay in registers across the taps, and unpacklo/hi and packs both
 * work per 128-bit lane, so the element order comes back. N > 0 is a compile-time tap count
 * (row pointers in registers, taps unrolled); N == 0 loops over n taps. */
static inline __attribute__((always_inline, target("avx2"))) void
vpass_avx2_impl(const uint8_t *const *rows, const int32_t *wpair, int n, Py_ssize_t len, int16_t *out, const int N)
{
    const __m256i round = _mm256_set1_epi32(1 << (VSHIFT - 1));
    const __m256i zero = _mm256_setzero_si256();
    if (N)
        n = N;
    const uint8_t *r0 = rows[0], *r1 = n > 1 ? rows[1] : NULL, *r2 = n > 2 ? rows[2] : NULL,
                  *r3 = n > 3 ? rows[3] : NULL;
    const __m256i w01 = _mm256_set1_epi32(wpair[0]), w23 = _mm256_set1_epi32(n > 2 ? wpair[1] : 0);
    Py_ssize_t x = 0;
    for (; x + 16 <= len; x += 16) {
        __m256i lo = round, hi = round;
        if (N) {
            const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r0 + x)));
            const __m256i b = N > 1 ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r1 + x))) : zero;
            lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), w01));
            hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), w01));
            if (N > 2) {
                const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r2 + x)));
                const __m256i d = N > 3 ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r3 + x))) : zero;
                lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(c, d), w23));
                hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(c, d), w23));
            }
        } else {
            for (int k = 0; k < n; k += 2) {
                const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(rows[k] + x)));
                const __m256i b =
                    k + 1 < n ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(rows[k + 1] + x))) : zero;
                const __m256i wv = _mm256_set1_epi32(wpair[k >> 1]);
                lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), wv));
                hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), wv));
            }
        }
        lo = _mm256_srai_epi32(lo, VSHIFT);
        hi = _mm256_srai_epi32(hi, VSHIFT);
        _mm256_storeu_si256((__m256i *)(out + x), _mm256_packs_epi32(lo, hi));
    }
    for (; x < len; x++) {
        int32_t a = 1 << (VSHIFT - 1);
        for (int k = 0; k < n; k++)
            a += (int32_t)(int16_t)(k & 1 ? wpair[k >> 1] >> 16 : wpair[k >> 1]) * rows[k][x];
        out[x] = (int16_t)(a >> VSHIFT);
    }
}

__attribute__((target("avx2"))) static void vpass_avx2(const uint8_t *const *rows, const int32_t *wpair, int n,
                                                       Py_ssize_t len, int16_t *out)
{
    switch (n) {
    case 1: vpass_avx2_impl(rows, wpair, n, len, out, 1); break;
    case 2: vpass_avx2_impl(rows, wpair, n, len, out, 2); break;
    case 3: vpass_avx2_impl(rows, wpair, n, len, out, 3); break;
    case 4: vpass_avx2_impl(rows, wpair, n, len, out, 4); break;
    default: vpass_avx2_impl(rows, wpair, n, len, out, 0); break;
    }
}

/* Four output pixels per iteration, two per 256-bit register (one per 128-bit lane), two
 * taps per vpmaddwd: a 16-byte load at tap pair j holds pixels sx+2j and sx+2j+1 (C=4), or
 * those and 2 spare int16 (C=3); a byte shuffle interleaves them per channel. wtab holds, per
 * pixel pair and tap pair, the weight pair of the first pixel x4 then of the second x4. The
 * four pixels go out in one 16-byte store (C=3: 12 bytes and 4 zero bytes that later stores
 * overwrite), so the caller passes npix short enough that it stays inside dst. C and kp2 are
 * compile-time constants in the instances below (the tap loop unrolls). Returns the pixels
 * done; hpass_c does the rest. */
static inline __attribute__((always_inline, target("avx2"))) __m256i
hpair_avx2(const int16_t *p0, const int16_t *p1, const __m256i *wv, const __m256i mask, const int C,
           const int kp2)
{
    __m256i acc = _mm256_set1_epi32(1 << (HSHIFT - 1));
    for (int j = 0; j < kp2; j++) {
        __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + j * 2 * C))),
                                            _mm_loadu_si128((const __m128i *)(p1 + j * 2 * C)), 1);
        v = _mm256_shuffle_epi8(v, mask);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_loadu_si256(wv + j)));
    }
    return _mm256_srai_epi32(acc, HSHIFT);
}

static inline __attribute__((always_inline, target("avx2"))) int
hpass_avx2_impl(const int16_t *tmp, const int32_t *off, const int32_t *wtab, int npix, uint8_t *out, const int C,
                const int kp2)
{
    const __m256i mask = C == 4 ? _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                                   0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
                                : _mm256_setr_epi8(0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1,
                                                   0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m128i pack3 = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i *w = (const __m256i *)wtab;
    int x = 0;
    for (; x + 4 <= npix; x += 4) {
        const __m256i a = hpair_avx2(tmp + off[x], tmp + off[x + 1], w + (size_t)(x >> 1) * kp2, mask, C, kp2);
        const __m256i b = hpair_avx2(tmp + off[x + 2], tmp + off[x + 3], w + (size_t)((x >> 1) + 1) * kp2, mask, C, kp2);
        /* lanes: a = [px0 | px1], b = [px2 | px3] -> bytes px0 px2 .. | px1 px3 .. -> px0..px3 */
        __m256i v = _mm256_packs_epi32(a, b);
        v = _mm256_packus_epi16(v, v);
        __m128i q = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(v, order));
        if (C == 3)
            q = _mm_shuffle_epi8(q, pack3);
        _mm_storeu_si128((__m128i *)(out + (size_t)x * C), q);
    }
    return x;
}

#define HPASS_INSTANCE(C, KP2)                                                                                   \
    __attribute__((target("avx2"))) static int hpass_avx2_##C##_##KP2(const int16_t *tmp, const int32_t *off,     \
                                                                      const int32_t *wtab, int npix, uint8_t *out, \
                                                                      int kp2)                                     \
    {                                                                                                              \
        return hpass_avx2_impl(tmp, off, wtab, npix, out, C, KP2 ? KP2 : kp2);                                     \
    }
HPASS_INSTANCE(3, 1)
HPASS_INSTANCE(3, 2)
HPASS_INSTANCE(3, 0)
HPASS_INSTANCE(4, 1)
HPASS_INSTANCE(4, 2)
HPASS_INSTANCE(4, 0)

typedef int (*hpass_fn)(const int16_t *, const int32_t *, const int32_t *, int, uint8_t *, int);

static hpass_fn hpass_avx2_for(int C, int kp2)
{
    if (C == 3)
        return kp2 == 1 ? hpass_avx2_3_1 : kp2 == 2 ? hpass_avx2_3_2 : hpass_avx2_3_0;
    if (C == 4)
        return kp2 == 1 ? hpass_avx2_4_1 : kp2 == 2 ? hpass_avx2_4_2 : hpass_avx2_4_0;
    return NULL;
}

static int have_avx2(void)
{
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return cached;
}
#endif

typedef struct {
    const uint8_t *src; /* first pixel of the first row */
    Py_ssize_t sstride; /* bytes between source rows (any sign) */
    uint8_t *dst;       /* C-contiguous oh x ow x C */
    int H, W, oh, ow, C;
    int simd;
} Job;

/* Returns 0, or -1 when out of memory. No Python API in here but PyMem_Raw*: runs without
 * the GIL. */
static int run(const Job *j)
{
    Taps ty = {0}, tx = {0};
    const uint8_t **rows = NULL;
    int16_t *tmp = NULL;
    int32_t *acc = NULL, *wpair = NULL, *wtab = NULL, *off = NULL;
    int status = -1;
    const Py_ssize_t len = (Py_ssize_t)j->W * j->C;
    const size_t orow = (size_t)j->ow * j->C;

    if (taps_build(&ty, j->H, j->oh) < 0 || taps_build(&tx, j->W, j->ow) < 0)
        goto done;
    rows = PyMem_RawMalloc((size_t)ty.kp * sizeof(*rows));
    wpair = PyMem_RawMalloc((size_t)(ty.kp / 2) * sizeof(int32_t));
    /* Zero padding after the row: zero-weight taps and the C=3 loads' 2 spare int16 read it. */
    tmp = PyMem_RawCalloc((size_t)len + (size_t)(tx.kp + 2) * j->C + 16, sizeof(int16_t));
    acc = PyMem_RawMalloc((size_t)len * sizeof(int32_t));
    if (rows == NULL || wpair == NULL || tmp == NULL || acc == NULL)
        goto done;

#if HAVE_AVX2_KERNELS
    const int use_avx2 = j->simd && have_avx2();
    const hpass_fn hsimd = use_avx2 ? hpass_avx2_for(j->C, tx.kp / 2) : NULL;
    if (hsimd) {
        off = PyMem_RawMalloc((size_t)j->ow * sizeof(int32_t));
        if (off == NULL)
            goto done;
        for (int x = 0; x < j->ow; x++)
            off[x] = tx.start[x] * j->C;
        const int kp2 = tx.kp / 2, pairs = (j->ow + 1) / 2;
        wtab = PyMem_RawCalloc((size_t)pairs * kp2 * 8, sizeof(int32_t));
        if (wtab == NULL)
            goto done;
        for (int x = 0; x < j->ow; x++) {
            const int16_t *w = tx.w + (size_t)x * tx.kp;
            for (int q = 0; q < kp2; q++) {
                const int32_t pr = (int32_t)(uint16_t)w[2 * q] | (int32_t)((uint32_t)(uint16_t)w[2 * q + 1] << 16);
                int32_t *cell = wtab + ((size_t)(x >> 1) * kp2 + q) * 8 + (x & 1) * 4;
                cell[0] = cell[1] = cell[2] = cell[3] = pr;
            }
        }
    }
#endif

    for (int y = 0; y < j->oh; y++) {
        const int n = ty.count[y];
        const int16_t *w = ty.w + (size_t)y * ty.kp;
        for (int k = 0; k < n; k++)
            rows[k] = j->src + (ty.start[y] + k) * j->sstride;
        uint8_t *out = j->dst + (size_t)y * orow;
        int done_px = 0;
#if HAVE_AVX2_KERNELS
        if (use_avx2) {
            for (int q = 0; q < (n + 1) / 2; q++)
                wpair[q] = (int32_t)(uint16_t)w[2 * q] |
                           (int32_t)((uint32_t)(uint16_t)(2 * q + 1 < n ? w[2 * q + 1] : 0) << 16);
            vpass_avx2(rows, wpair, n, len, tmp);
        } else
#endif
            vpass_c(rows, w, n, len, acc, tmp);
#if HAVE_AVX2_KERNELS
        if (hsimd) {
            /* In the last row, C=3's 4 spare bytes must not land past dst. */
            const int npix = (y == j->oh - 1 && j->C == 3) ? j->ow - 2 : j->ow;
            done_px = hsimd(tmp, off, wtab, npix, out, tx.kp / 2);
        }
#endif
        hpass_c(tmp, &tx, j->ow, j->C, done_px, out);
    }
    status = 0;
done:
    taps_free(&ty);
    taps_free(&tx);
    PyMem_RawFree(rows);
    PyMem_RawFree(wpair);
    PyMem_RawFree(tmp);
    PyMem_RawFree(acc);
    PyMem_RawFree(wtab);
    PyMem_RawFree(off);
    return status;
}

static int is_u8(const Py_buffer *v)
{
    const char *f = v->format;
    if (v->itemsize != 1 || f == NULL)
        return 0;
    if (f[0] == '@' || f[0] == '=' || f[0] == '<' || f[0] == '>' || f[0] == '!')
        f++;
    return f[0] == 'B' && f[1] == '\0';
}

PyDoc_STRVAR(resize_area_doc,
"resize_area(src, dst, simd=True) -> None\n\n"
"Shrink src (H x W x C or H x W uint8, C in 1..4, rows C-contiguous: a crop view of a\n"
"contiguous image is fine) into dst (oh x ow x C, C-contiguous, writable) with an area\n"
"(box) filter, what cv2.INTER_AREA computes for oh <= H and ow <= W, within 1 of it.\n"
"simd=False forces the portable kernels (same results; for tests). Releases the GIL.\n"
"Raises ValueError for a wrong dtype, shape, layout or an enlarging size.");

static PyObject *resize_area(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"src", "dst", "simd", NULL};
    PyObject *srcobj, *dstobj;
    int simd = 1;
    Py_buffer s = {0}, d = {0};
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|p:resize_area", kwlist, &srcobj, &dstobj, &simd))
        return NULL;
    if (PyObject_GetBuffer(srcobj, &s, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "src must be an array supporting the strided buffer protocol");
        }
        return NULL;
    }
    if (PyObject_GetBuffer(dstobj, &d, PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_ValueError)) { /* NumPy: "buffer source array is read-only" */
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "dst must be a writable array");
        }
        goto done;
    }
    if (!is_u8(&s) || !is_u8(&d)) {
        PyErr_Format(PyExc_ValueError, "src and dst must be uint8 (formats '%s' and '%s')",
                     s.format ? s.format : "?", d.format ? d.format : "?");
        goto done;
    }
    if ((s.ndim != 2 && s.ndim != 3) || d.ndim != s.ndim) {
        PyErr_Format(PyExc_ValueError, "src and dst must both be HxW or HxWxC, got %d and %d dimensions", s.ndim,
                     d.ndim);
        goto done;
    }
    const Py_ssize_t C = s.ndim == 3 ? s.shape[2] : 1;
    if (C < 1 || C > 4 || (d.ndim == 3 && d.shape[2] != C)) {
        PyErr_Format(PyExc_ValueError, "src and dst need the same channel count, 1 to 4 (got %zd and %zd)", C,
                     d.ndim == 3 ? d.shape[2] : 1);
        goto done;
    }
    const Py_ssize_t H = s.shape[0], W = s.shape[1], oh = d.shape[0], ow = d.shape[1];
    if (H < 1 || W < 1 || oh < 1 || ow < 1) {
        PyErr_Format(PyExc_ValueError, "empty image: src %zdx%zd, dst %zdx%zd", H, W, oh, ow);
        goto done;
    }
    if (oh > H || ow > W) {
        PyErr_Format(PyExc_ValueError,
                     "area resize only shrinks: dst %zdx%zd is larger than src %zdx%zd on an axis "
                     "(use INTER_LINEAR to enlarge)", oh, ow, H, W);
        goto done;
    }
    if (H > INT32_MAX / 2 || W > INT32_MAX / 8) {
        PyErr_SetString(PyExc_ValueError, "image too large");
        goto done;
    }
    /* Strides of length-1 axes mean nothing (NumPy may set any), so they are not checked. */
    if ((s.ndim == 3 && C > 1 && s.strides[2] != 1) || (W > 1 && s.strides[1] != C)) {
        PyErr_SetString(PyExc_ValueError, "src rows must be C-contiguous (pixels packed, channels last)");
        goto done;
    }
    if (!PyBuffer_IsContiguous(&d, 'C')) {
        PyErr_SetString(PyExc_ValueError, "dst must be C-contiguous");
        goto done;
    }
    Job job = {(const uint8_t *)s.buf, s.strides[0], (uint8_t *)d.buf, (int)H, (int)W, (int)oh, (int)ow, (int)C,
               simd};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run(&job);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    if (d.obj != NULL)
        PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return result;
}

static PyObject *simd_kernels(PyObject *self, PyObject *noargs)
{
#if HAVE_AVX2_KERNELS
    return PyUnicode_FromString(have_avx2() ? "avx2" : "none");
#else
    return PyUnicode_FromString("none");
#endif
}

static PyMethodDef methods[] = {
    {"resize_area", (PyCFunction)(void (*)(void))resize_area, METH_VARARGS | METH_KEYWORDS, resize_area_doc},
    {"simd", simd_kernels, METH_NOARGS, "The SIMD kernels this CPU uses: 'avx2' or 'none'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._resize",
    "Area (box-filter) downscaling of uint8 images, like cv2.INTER_AREA for shrinking.", -1, methods,
};

PyMODINIT_FUNC PyInit__resize(void)
{
    return PyModule_Create(&module);
}
