/* fastload._resize: resizing of uint8 HWC images: area (box-filter) downscaling, what OpenCV's
 * INTER_AREA computes when shrinking, and bilinear, what INTER_LINEAR computes (see the
 * horizontal-first path below), in a fraction of their time, with an optional left-right flip.
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
    int linear; /* built by taps_build_linear: count 1 or 2, weights w[2o] + w[2o+1] = 1 << WBITS */
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

/* Bilinear taps for in -> out (any ratio), OpenCV's INTER_LINEAR mapping: output o samples
 * f = (o + 0.5) * in / out - 0.5, clamped to the first and last input (where it reads one
 * input only). Two taps (1 - a, a) with a = f - floor(f), quantised so they sum to 1 << WBITS;
 * a zero second weight gets count 1, so no row or column past the image is ever read. */
static int taps_build_linear(Taps *t, int64_t in, int64_t out)
{
    t->kp = 2;
    t->linear = 1;
    t->start = PyMem_RawMalloc((size_t)out * sizeof(int32_t));
    t->count = PyMem_RawMalloc((size_t)out * sizeof(int32_t));
    t->w = PyMem_RawCalloc((size_t)out * 2, sizeof(int16_t));
    if (t->start == NULL || t->count == NULL || t->w == NULL) {
        taps_free(t);
        return -1;
    }
    const double scale = (double)in / (double)out;
    for (int64_t o = 0; o < out; o++) {
        const double f = ((double)o + 0.5) * scale - 0.5;
        int64_t s = (int64_t)f;
        if ((double)s > f) /* floor for negative f */
            s--;
        double a = f - (double)s;
        if (s < 0) {
            s = 0;
            a = 0.0;
        }
        if (s >= in - 1) {
            s = in - 1;
            a = 0.0;
        }
        const int32_t w1 = (int32_t)(a * (double)(1 << WBITS) + 0.5);
        t->start[o] = (int32_t)s;
        t->w[o * 2] = (int16_t)((1 << WBITS) - w1);
        t->w[o * 2 + 1] = (int16_t)w1;
        t->count[o] = w1 > 0 ? 2 : 1;
        if (w1 == (1 << WBITS)) { /* a rounded up to 1: read the next input alone */
            t->start[o] = (int32_t)(s + 1);
            t->w[o * 2] = (int16_t)(1 << WBITS);
            t->w[o * 2 + 1] = 0;
            t->count[o] = 1;
        }
    }
    return 0;
}

/* Mirror the output axis: output o takes the taps of output out - 1 - o. */
static void taps_reverse(Taps *t, int64_t out)
{
    for (int64_t a = 0, b = out - 1; a < b; a++, b--) {
        int32_t s = t->start[a];
        t->start[a] = t->start[b];
        t->start[b] = s;
        s = t->count[a];
        t->count[a] = t->count[b];
        t->count[b] = s;
        for (int k = 0; k < t->kp; k++) {
            const int16_t w = t->w[a * t->kp + k];
            t->w[a * t->kp + k] = t->w[b * t->kp + k];
            t->w[b * t->kp + k] = w;
        }
    }
}

/* Taps for one axis: mode 0 = area when shrinking, bilinear otherwise (a different filter per
 * axis when one shrinks and the other grows, as PIL's separable resize); 1 = bilinear. */
static int taps_for(Taps *t, int64_t in, int64_t out, int mode)
{
    if (mode == 0 && out < in)
        return taps_build(t, in, out);
    return taps_build_linear(t, in, out);
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
    int mode; /* taps_for's mode for both axes */
    int flip; /* mirror the output left-right */
} Job;


/* ---- horizontal first, from bytes, with cached rows ----
 *
 * RandomResizedCrop enlarges most boxes (82% of 256x341 JPEG samples, 85% of raw 256x256
 * ones) and shrinks the rest by less than 2x, so this is the hot path. The generic passes
 * above spend most of their time in the horizontal pass's per-pixel loads. Here each output
 * row value k (channel k % C of pixel k / C) is a weighted sum of at most 4 source bytes; the
 * horizontal tap table is the same for every row, so it is turned once into, per group of 4
 * values, a 16-byte source window and, per pair of taps, a byte shuffle that zero-extends the
 * 4 values' byte pairs into int16: one vpshufb and one vpmaddwd per tap pair give 4 values per
 * 128-bit lane, whatever C is (and a flip is just another table). The result row, int16 with
 * TBITS fractional bits, is computed once per source row and cached while output rows still
 * need it (an enlarging axis reads each source row about twice). The vertical pass is then
 * r0 + (r1 - r0) * b on whole cached rows, as a rounding multiply (vpmulhrsw).
 *
 * Used when the vertical axis is bilinear, the horizontal taps are at most 4 per pixel (area
 * up to ~1.5x shrink, bilinear any), the source row holds at least 16 bytes and every group's
 * bytes fit in 16; the generic passes do the rest. The portable kernels below give
 * bit-identical results.
 */
typedef struct {
    int32_t *base; /* per group: window start, in bytes from the row start */
    uint8_t *mask; /* per block of 4 groups and tap pair: 4 x 16 shuffle bytes, groups 0 2 1 3 */
    int16_t *wt;   /* the same layout: 4 x 8 int16, a (w, w') pair per value */
    int16_t *vb;   /* bilinear rows: per output row, Q15 weight of the second source row */
    int groups;    /* ceil(ow * C / 4), rounded up to a multiple of 4 */
    int kp2;       /* horizontal tap pairs: 1 or 2 */
} HTab;

static void htab_free(HTab *t)
{
    PyMem_RawFree(t->base);
    PyMem_RawFree(t->mask);
    PyMem_RawFree(t->wt);
    PyMem_RawFree(t->vb);
    t->base = NULL;
    t->mask = NULL;
    t->wt = NULL;
    t->vb = NULL;
}

/* Position of group g's entry for tap pair q in the mask / weight tables. */
static inline size_t htab_entry(int g, int q, int kp2)
{
    static const int order[4] = {0, 2, 1, 3};
    return ((size_t)(g >> 2) * kp2 + q) * 4 + order[g & 3];
}

/* Returns 1 when built, 0 when this path does not apply, -1 when out of memory. */
static int htab_build(HTab *t, const Taps *tx, const Taps *ty, int W, int ow, int oh, int C)
{
    const int64_t rowlen = (int64_t)W * C, nval = (int64_t)ow * C;
    if (rowlen < 16 || tx->kp > 4)
        return 0;
    /* Whether the path applies must not depend on flip (a mirrored result must be the exact
     * mirror), so check every run of adjacent pixels a group can hold, whichever way round. */
    const int run = C == 1 ? 4 : C == 4 ? 1 : 2;
    for (int x = 0; x + run <= ow; x++) {
        int64_t lo = INT64_MAX, hi = -1;
        for (int i = x; i < x + run; i++) {
            const int64_t a = (int64_t)tx->start[i] * C, b = ((int64_t)tx->start[i] + tx->count[i]) * C - 1;
            lo = a < lo ? a : lo;
            hi = b > hi ? b : hi;
        }
        if (hi - lo >= 16)
            return 0;
    }
    t->kp2 = tx->kp / 2;
    t->groups = (int)(((nval + 3) / 4 + 3) & ~(int64_t)3);
    t->base = PyMem_RawCalloc((size_t)t->groups, sizeof(int32_t));
    t->mask = PyMem_RawMalloc((size_t)t->groups * t->kp2 * 16);
    t->wt = PyMem_RawCalloc((size_t)t->groups * t->kp2 * 8, sizeof(int16_t));
    t->vb = PyMem_RawMalloc((size_t)oh * sizeof(int16_t));
    if (t->base == NULL || t->mask == NULL || t->wt == NULL || t->vb == NULL)
        return -1;
    memset(t->mask, 0x80, (size_t)t->groups * t->kp2 * 16); /* unused lanes read zero */
    int64_t x = 0, c = 0;                                   /* pixel and channel of value k */
    for (int g = 0; g * 4 < nval; g++) {
        int64_t lo = INT64_MAX, hi = -1, px[4], ch[4];
        const int n = nval - g * 4 < 4 ? (int)(nval - g * 4) : 4;
        for (int i = 0; i < n; i++) {
            px[i] = x;
            ch[i] = c;
            const int64_t a = (int64_t)tx->start[x] * C + c, b = a + (int64_t)(tx->count[x] - 1) * C;
            lo = a < lo ? a : lo;
            hi = b > hi ? b : hi;
            if (++c == C) {
                c = 0;
                x++;
            }
        }
        if (hi - lo >= 16) /* cannot happen after the check above; kept as a guard */
            return 0;
        const int64_t b = lo + 16 <= rowlen ? lo : rowlen - 16; /* never read past the row */
        t->base[g] = (int32_t)b;
        for (int i = 0; i < n; i++) {
            const int64_t xi = px[i], first = (int64_t)tx->start[xi] * C + ch[i] - b;
            for (int k = 0; k < tx->count[xi]; k++) {
                const size_t e = htab_entry(g, k >> 1, t->kp2);
                t->mask[e * 16 + 4 * i + 2 * (k & 1)] = (uint8_t)(first + (int64_t)k * C);
                t->wt[e * 8 + 2 * i + (k & 1)] = tx->w[xi * tx->kp + k];
            }
        }
    }
    for (int y = 0; y < oh; y++) /* ty is bilinear: WBITS -> Q15, below 1 << 15 since a < 1 */
        t->vb[y] = ty->count[y] == 2 ? (int16_t)(ty->w[y * 2 + 1] << (15 - WBITS)) : 0;
    return 1;
}

#define HROUND (1 << (WBITS - TBITS - 1))

static void hf_hrow_c(const uint8_t *src, const HTab *t, int16_t *out)
{
    for (int g = 0; g < t->groups; g++) {
        const uint8_t *win = src + t->base[g];
        int32_t acc[4] = {HROUND, HROUND, HROUND, HROUND};
        for (int q = 0; q < t->kp2; q++) {
            const size_t e = htab_entry(g, q, t->kp2);
            const uint8_t *m = t->mask + e * 16;
            const int16_t *w = t->wt + e * 8;
            for (int i = 0; i < 4; i++) {
                const int32_t a = m[4 * i] & 0x80 ? 0 : win[m[4 * i]], b = m[4 * i + 2] & 0x80 ? 0 : win[m[4 * i + 2]];
                acc[i] += a * w[2 * i] + b * w[2 * i + 1];
            }
        }
        for (int i = 0; i < 4; i++)
            out[g * 4 + i] = (int16_t)(acc[i] >> (WBITS - TBITS));
    }
}

/* What vpmulhrsw computes: (a * b + 2^14) >> 15. */
static inline int16_t mulhrs(int32_t a, int32_t b)
{
    return (int16_t)((a * b + (1 << 14)) >> 15);
}

static void hf_vrow2_c(const int16_t *const *r, int16_t b, int n, uint8_t *out)
{
    const int16_t *r0 = r[0], *r1 = r[1];
    for (int i = 0; i < n; i++) {
        const int16_t v = (int16_t)(r0[i] + mulhrs((int16_t)(r1[i] - r0[i]), b));
        out[i] = clamp_u8(mulhrs(v, 1 << (15 - TBITS)));
    }
}

#if HAVE_AVX2_KERNELS
/* 16 values per iteration: windows of groups (g, g+2) in one register and (g+1, g+3) in the
 * other, so vpackssdw's per-lane packing puts them back in order (the tables are stored so).
 * KP2 is a compile-time tap-pair count. */
static inline __attribute__((always_inline, target("avx2"))) void
hf_hrow_avx2_impl(const uint8_t *src, const HTab *t, int16_t *out, const int KP2)
{
    const __m256i round = _mm256_set1_epi32(HROUND);
    const __m256i *mask = (const __m256i *)t->mask, *wt = (const __m256i *)t->wt;
    const int32_t *base = t->base;
    for (int g = 0; g < t->groups; g += 4) {
        const __m256i a = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(src + base[g]))),
            _mm_loadu_si128((const __m128i *)(src + base[g + 2])), 1);
        const __m256i b = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(src + base[g + 1]))),
            _mm_loadu_si128((const __m128i *)(src + base[g + 3])), 1);
        __m256i sa = round, sb = round;
        for (int q = 0; q < KP2; q++) {
            const size_t e = ((size_t)(g >> 2) * KP2 + q) * 2; /* in 32-byte units */
            sa = _mm256_add_epi32(sa, _mm256_madd_epi16(_mm256_shuffle_epi8(a, _mm256_loadu_si256(mask + e)),
                                                        _mm256_loadu_si256(wt + e)));
            sb = _mm256_add_epi32(sb, _mm256_madd_epi16(_mm256_shuffle_epi8(b, _mm256_loadu_si256(mask + e + 1)),
                                                        _mm256_loadu_si256(wt + e + 1)));
        }
        sa = _mm256_srai_epi32(sa, WBITS - TBITS);
        sb = _mm256_srai_epi32(sb, WBITS - TBITS);
        _mm256_storeu_si256((__m256i *)(out + g * 4), _mm256_packs_epi32(sa, sb));
    }
}

__attribute__((target("avx2"))) static void hf_hrow_avx2_1(const uint8_t *src, const HTab *t, int16_t *out)
{
    hf_hrow_avx2_impl(src, t, out, 1);
}

__attribute__((target("avx2"))) static void hf_hrow_avx2_2(const uint8_t *src, const HTab *t, int16_t *out)
{
    hf_hrow_avx2_impl(src, t, out, 2);
}

__attribute__((target("avx2"))) static void hf_vrow2_avx2(const int16_t *const *r, int16_t b, int n, uint8_t *out)
{
    const int16_t *r0 = r[0], *r1 = r[1];
    const __m256i bv = _mm256_set1_epi16(b), down = _mm256_set1_epi16(1 << (15 - TBITS));
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)(r0 + i)), a1 = _mm256_loadu_si256((const __m256i *)(r0 + i + 16));
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)(r1 + i)), c1 = _mm256_loadu_si256((const __m256i *)(r1 + i + 16));
        __m256i v0 = _mm256_add_epi16(a0, _mm256_mulhrs_epi16(_mm256_sub_epi16(c0, a0), bv));
        __m256i v1 = _mm256_add_epi16(a1, _mm256_mulhrs_epi16(_mm256_sub_epi16(c1, a1), bv));
        v0 = _mm256_mulhrs_epi16(v0, down);
        v1 = _mm256_mulhrs_epi16(v1, down);
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute4x64_epi64(_mm256_packus_epi16(v0, v1), 0xD8));
    }
    const int16_t *rest[2] = {r0 + i, r1 + i};
    hf_vrow2_c(rest, b, n - i, out + i);
}

#endif

/* Returns 1 when done, 0 when this path does not apply (the caller runs the generic one),
 * -1 when out of memory. */
static int run_hfirst(const Job *j, const Taps *ty, const Taps *tx)
{
    HTab t = {0};
    int16_t *cache = NULL;
    int64_t *held = NULL;
    /* Only for a vertical axis that is bilinear (grows, keeps its size, or filter="linear"):
     * when it shrinks with the area filter there are more source rows than output rows, and
     * the generic passes (vertical first, over bytes) do less work. */
    if (!ty->linear)
        return 0;
    int status = htab_build(&t, tx, ty, j->W, j->ow, j->oh, j->C);
    if (status <= 0)
        goto done;
    status = -1;
    const int R = 2; /* cached rows: row s lives in slot s % 2 (an output row reads rows s and s + 1) */
    const int stride = t.groups * 4; /* int16 per cached row */
    cache = PyMem_RawMalloc((size_t)stride * R * sizeof(int16_t));
    held = PyMem_RawMalloc((size_t)R * sizeof(int64_t));
    if (cache == NULL || held == NULL)
        goto done;
    for (int k = 0; k < R; k++)
        held[k] = -1;
    void (*hrow)(const uint8_t *, const HTab *, int16_t *) = hf_hrow_c;
    void (*vrow2)(const int16_t *const *, int16_t, int, uint8_t *) = hf_vrow2_c;
#if HAVE_AVX2_KERNELS
    if (j->simd && have_avx2()) {
        hrow = t.kp2 == 1 ? hf_hrow_avx2_1 : hf_hrow_avx2_2;
        vrow2 = hf_vrow2_avx2;
    }
#endif
    const int n = j->ow * j->C;
    const int16_t *r[2];
    for (int y = 0; y < j->oh; y++) {
        const int64_t s0 = ty->start[y];
        const int cnt = ty->count[y];
        for (int k = 0; k < 2; k++) {
            const int64_t s = s0 + (k < cnt ? k : cnt - 1); /* one tap: both rows are s0 */
            const int q = (int)(s % R);
            if (held[q] != s) {
                hrow(j->src + s * j->sstride, &t, cache + (size_t)q * stride);
                held[q] = s;
            }
            r[k] = cache + (size_t)q * stride;
        }
        vrow2(r, t.vb[y], n, j->dst + (size_t)y * n);
    }
    status = 1;
done:
    htab_free(&t);
    PyMem_RawFree(cache);
    PyMem_RawFree(held);
    return status;
}

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

    if (taps_for(&ty, j->H, j->oh, j->mode) < 0 || taps_for(&tx, j->W, j->ow, j->mode) < 0)
        goto done;
    if (j->flip)
        taps_reverse(&tx, j->ow);
    {
        const int r = run_hfirst(j, &ty, &tx);
        if (r != 0) {
            status = r > 0 ? 0 : -1;
            goto done;
        }
    }
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

PyDoc_STRVAR(resize_doc,
"resize(src, dst, linear=False, flip=False, simd=True) -> None\n\n"
"Resize src into dst (same layouts as resize_area), any sizes. linear=False: per axis, the\n"
"area filter where that axis shrinks and bilinear where it grows or keeps its size;\n"
"linear=True: bilinear on both axes, OpenCV's INTER_LINEAR (within 1 of it). flip=True\n"
"writes the result mirrored left-right at no extra cost. Releases the GIL.");

/* Shared by both entry points: parse, check, run without the GIL. */
static PyObject *resize_impl(PyObject *srcobj, PyObject *dstobj, int simd, int mode, int flip, int shrink_only)
{
    Py_buffer s = {0}, d = {0};
    PyObject *result = NULL;

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
    if (shrink_only && (oh > H || ow > W)) {
        PyErr_Format(PyExc_ValueError,
                     "area resize only shrinks: dst %zdx%zd is larger than src %zdx%zd on an axis "
                     "(use INTER_LINEAR to enlarge)", oh, ow, H, W);
        goto done;
    }
    if (H > INT32_MAX / 2 || W > INT32_MAX / 8 || oh > INT32_MAX / 8 || ow > INT32_MAX / 8) {
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
               simd, mode, flip};
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

static PyObject *resize_area(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"src", "dst", "simd", NULL};
    PyObject *srcobj, *dstobj;
    int simd = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|p:resize_area", kwlist, &srcobj, &dstobj, &simd))
        return NULL;
    return resize_impl(srcobj, dstobj, simd, 0, 0, 1);
}

static PyObject *resize(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"src", "dst", "linear", "flip", "simd", NULL};
    PyObject *srcobj, *dstobj;
    int linear = 0, flip = 0, simd = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|ppp:resize", kwlist, &srcobj, &dstobj, &linear, &flip, &simd))
        return NULL;
    return resize_impl(srcobj, dstobj, simd, linear ? 1 : 0, flip, 0);
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
    {"resize", (PyCFunction)(void (*)(void))resize, METH_VARARGS | METH_KEYWORDS, resize_doc},
    {"simd", simd_kernels, METH_NOARGS, "The SIMD kernels this CPU uses: 'avx2' or 'none'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._resize",
    "Area (box-filter) and bilinear resizing of uint8 images, like cv2.INTER_AREA / INTER_LINEAR.", -1, methods,
};

PyMODINIT_FUNC PyInit__resize(void)
{
    return PyModule_Create(&module);
}
