/* fastload._jpegcrop: decode only a box of a JPEG, optionally DCT-downscaled.
 *
 * RandomResizedCrop keeps on average about half of a decoded image. libjpeg-turbo's libjpeg
 * API can skip the rows above the box without an inverse DCT (jpeg_skip_scanlines), leave out
 * the columns outside it (jpeg_crop_scanline, aligned to iMCU columns), and stop after its
 * last row; the TurboJPEG API that simplejpeg and jpeg4py wrap cannot. This module is that
 * one function, on the plain CPython C API, without numpy: it fills a bytearray (or a
 * caller's writable buffer) with the box as packed RGB rows; fastload.codecs.jpegcrop wraps
 * it into an HWC uint8 array.
 *
 * Restart segments: Huffman data is one bit stream, so libjpeg must entropy-decode every MCU
 * before the box's last one, beside and above the box too, even where it skips the inverse
 * DCT. A JPEG with restart markers every k MCUs, k dividing the MCUs of a row (what
 * fastload's jpeg payload is packed with), is a grid of independently coded segments. When
 * the input has such a grid, decode_crop copies just the segments that cover the box (plus a
 * 2-pixel margin for chroma upsampling) into a smaller JPEG (the same header with the frame
 * size patched, restart markers renumbered) and decodes that: same pixels, ~17% less decode
 * time for RandomResizedCrop boxes of 256x341 photos (though libjpeg-turbo leaves its fast
 * Huffman path off for any stream with restart markers). Any other input takes the plain path.
 *
 * Errors: libjpeg's error_exit longjmps back here. Corrupt-data warnings (premature end of
 * data, bad Huffman codes...) are errors too, so a truncated JPEG raises instead of coming
 * back grey-filled; header oddities that do not affect pixels (unknown JFIF revision, Adobe
 * transform code, bogus ICC chunk) are ignored. Colour spaces other than grayscale, YCbCr and
 * RGB (CMYK, YCCK) raise Unsupported, so the caller can fall back to another decoder.
 *
 * The decode runs with the GIL released: between Py_BEGIN/END_ALLOW_THREADS only libjpeg and
 * memcpy touch memory the caller keeps alive (the input and output buffers are held through
 * Py_buffer views).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#ifndef LIBJPEG_TURBO_VERSION_NUMBER
#error "fastload._jpegcrop needs libjpeg-turbo >= 1.5 (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

static PyObject *JpegError;   /* corrupt or unreadable data */
static PyObject *Unsupported; /* valid JPEG this path does not handle (CMYK, YCCK) */

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void error_exit(j_common_ptr cinfo)
{
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void emit_message(j_common_ptr cinfo, int msg_level)
{
    if (msg_level >= 0)
        return; /* trace messages */
    switch (cinfo->err->msg_code) {
    case JWRN_JFIF_MAJOR:
    case JWRN_ADOBE_XFORM:
    case JWRN_BOGUS_ICC:
        return; /* header oddities; the pixels are fine */
    default:
        error_exit(cinfo); /* corrupt data: refuse rather than return grey fill */
    }
}

/* ---- Restart-segment grid ------------------------------------------------------------- */

typedef struct {
    size_t sof;                /* offset of the SOF marker (its height is at sof + 5) */
    size_t data;               /* first byte of the scan's entropy-coded data */
    unsigned width, height;    /* full-size frame */
    unsigned mcu_w, mcu_h;     /* full-size pixels of one MCU */
    unsigned mcus_per_row, mcu_rows;
    unsigned interval;         /* restart interval, MCUs; divides mcus_per_row */
} Grid;

static unsigned be16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

/* Fills *g and returns 1 when `b` is a sequential Huffman JPEG, one scan holding every
 * component, with a restart interval that divides the MCUs of a row. 0 otherwise (no
 * restarts, progressive, arithmetic coded, several scans, odd markers, truncated header):
 * the caller then decodes the plain way, which also reports anything corrupt. */
static int find_grid(const unsigned char *b, size_t n, Grid *g)
{
    int nf = 0, hmax = 1, vmax = 1;
    memset(g, 0, sizeof(*g));
    if (n < 4 || b[0] != 0xFF || b[1] != 0xD8)
        return 0;
    size_t i = 2;
    for (;;) {
        if (i + 4 > n || b[i] != 0xFF)
            return 0;
        while (i + 4 <= n && b[i + 1] == 0xFF) /* fill bytes */
            i++;
        if (i + 4 > n)
            return 0;
        const unsigned m = b[i + 1], len = be16(b + i + 2);
        if (len < 2 || i + 2 + len > n)
            return 0;
        const unsigned char *seg = b + i + 4;
        if (m == 0xC0 || m == 0xC1) { /* baseline / extended sequential, Huffman */
            if (len < 8 || nf != 0)
                return 0;
            g->sof = i;
            g->height = be16(seg + 1);
            g->width = be16(seg + 3);
            nf = seg[5];
            if ((nf != 1 && nf != 3) || len < 8 + 3 * (unsigned)nf || g->height == 0 || g->width == 0)
                return 0;
            for (int c = 0; c < nf; c++) {
                int h = seg[7 + 3 * c] >> 4, v = seg[7 + 3 * c] & 15;
                if (h < 1 || h > 4 || v < 1 || v > 4)
                    return 0;
                hmax = h > hmax ? h : hmax;
                vmax = v > vmax ? v : vmax;
            }
        } else if ((m >= 0xC2 && m <= 0xCB && m != 0xC4 && m != 0xC8) || (m >= 0xCD && m <= 0xCF)) {
            return 0; /* progressive, lossless, arithmetic coded */
        } else if (m == 0xDD) {
            if (len != 4)
                return 0;
            g->interval = be16(seg);
        } else if (m == 0xDA) {
            if (nf == 0 || len < 3 || seg[0] != nf)
                return 0; /* a scan without every component: several scans */
            g->data = i + 2 + len;
            break;
        } else if (m == 0xD8 || m == 0xD9 || (m >= 0xD0 && m <= 0xD7) || m == 0xDC) {
            return 0; /* SOI/EOI/RSTn in the header, or DNL */
        }
        i += 2 + len;
    }
    if (g->interval == 0)
        return 0;
    /* One component: a non-interleaved scan, MCU = one 8x8 block whatever its sampling. */
    g->mcu_w = nf == 1 ? 8 : 8 * (unsigned)hmax;
    g->mcu_h = nf == 1 ? 8 : 8 * (unsigned)vmax;
    g->mcus_per_row = (g->width + g->mcu_w - 1) / g->mcu_w;
    g->mcu_rows = (g->height + g->mcu_h - 1) / g->mcu_h;
    return g->mcus_per_row % g->interval == 0;
}

/* The segments of `g` covering full-size rows y0..y1, columns x0..x1 (end-exclusive), as a
 * JPEG in `out` (at least n + 2 bytes): the header with the frame size patched, the
 * segments, renumbered RSTn markers between them, EOI. Returns its length and the
 * full-size offset of its top-left pixel in *oy, *ox; 0 when the segments are not all
 * there (truncated or corrupt data: the plain path reports it). */
static size_t cut_segments(const unsigned char *b, size_t n, const Grid *g, unsigned y0, unsigned y1,
                           unsigned x0, unsigned x1, unsigned char *out, unsigned *oy, unsigned *ox)
{
    const unsigned seg_w = g->interval * g->mcu_w, per_row = g->mcus_per_row / g->interval;
    const unsigned r0 = y0 / g->mcu_h, r1 = (y1 - 1) / g->mcu_h, c0 = x0 / seg_w, c1 = (x1 - 1) / seg_w;
    const unsigned last = r1 * per_row + c1; /* the last segment needed */
    const unsigned sub_h = (r1 + 1) * g->mcu_h < g->height ? (r1 + 1) * g->mcu_h - r0 * g->mcu_h
                                                          : g->height - r0 * g->mcu_h;
    const unsigned sub_w = (c1 + 1) * seg_w < g->width ? (c1 + 1) * seg_w - c0 * seg_w : g->width - c0 * seg_w;
    if (sub_h > 0xFFFF || sub_w > 0xFFFF)
        return 0;
    memcpy(out, b, g->data);
    out[g->sof + 5] = (unsigned char)(sub_h >> 8);
    out[g->sof + 6] = (unsigned char)sub_h;
    out[g->sof + 7] = (unsigned char)(sub_w >> 8);
    out[g->sof + 8] = (unsigned char)sub_w;
    size_t o = g->data;
    unsigned copied = 0;
    const unsigned char *p = b + g->data, *start = p, *const end = b + n;
    for (unsigned s = 0;; s++) {
        /* Find the marker that ends segment s: 0xFF not followed by 0x00 (byte stuffing). */
        const unsigned char *q = p;
        for (;;) {
            q = memchr(q, 0xFF, (size_t)(end - q));
            if (q == NULL)
                return 0;
            while (q + 1 < end && q[1] == 0xFF)
                q++;
            if (q + 1 >= end)
                return 0;
            if (q[1] != 0x00)
                break;
            q += 2;
        }
        const unsigned m = q[1];
        const unsigned row = s / per_row, col = s % per_row;
        if (row >= r0 && col >= c0 && col <= c1) {
            if (copied > 0) {
                out[o++] = 0xFF;
                out[o++] = (unsigned char)(0xD0 + ((copied - 1) & 7));
            }
            memcpy(out + o, start, (size_t)(q - start));
            o += (size_t)(q - start);
            copied++;
        }
        if (s == last)
            break;
        if (m != 0xD0 + (s & 7))
            return 0; /* EOI or another marker early, or a restart out of sequence */
        p = start = q + 2;
    }
    out[o++] = 0xFF;
    out[o++] = 0xD9;
    *oy = r0 * g->mcu_h;
    *ox = c0 * seg_w;
    return o;
}

typedef struct {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    JDIMENSION top, left, height, width; /* the box, in scaled output pixels */
    size_t stride;                       /* bytes from one output row to the next */
    unsigned char *out;                  /* height * stride bytes */
    size_t offset;                       /* set by decode_box: bytes from out to the box's first pixel */
    int denom, fast;                     /* decode settings, applied again to a cut-out JPEG */
    /* Restart-segment cut (use_grid): the input, its grid, the full-size area to cover. */
    int use_grid;
    Grid grid;
    const unsigned char *in;
    size_t in_len;
    unsigned y0, y1, x0, x1;
    unsigned char *sub; /* the cut-out JPEG, freed by the caller */
} Job;

/* [start - margin, end + margin) clipped to [0, limit), then widened to at least 16 (or all
 * of limit): libjpeg picks plain (not fancy) upsampling for a component only 1-2 samples
 * wide, so a very narrow region would change pixels. */
static void widen(long start, long end, long margin, long limit, long *lo, long *hi)
{
    long a = start >= margin ? start - margin : 0, b = end + margin < limit ? end + margin : limit;
    if (b - a < 16) {
        b = a + 16 < limit ? a + 16 : limit;
        a = b > 16 ? b - 16 : 0;
    }
    *lo = a;
    *hi = b;
}

/* Decode settings, after every jpeg_read_header. */
static void configure(j_decompress_ptr cinfo, int denom, int fast)
{
    cinfo->out_color_space = JCS_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)denom;
    /* fast: libjpeg-turbo's fast integer IDCT (FFCV's TJFLAG_FASTDCT) and merged chroma
     * upsampling (TJFLAG_FASTUPSAMPLE): ~10% less decode time, slightly different pixels. */
    cinfo->dct_method = fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo->do_fancy_upsampling = fast ? FALSE : TRUE;
    jpeg_calc_output_dimensions(cinfo);
}

/* Rows top..top+height, columns left..left+width of the scaled image into job->out.
 * Returns 0, or -1 with job->err.message set. No Python API in here: runs without the GIL. */
static int decode_box(Job *job)
{
    j_decompress_ptr cinfo = &job->cinfo;
    if (setjmp(job->err.jump))
        return -1;
    if (job->use_grid) {
        job->sub = malloc(job->in_len + 2);
        if (job->sub == NULL) {
            strcpy(job->err.message, "out of memory for the cut-out JPEG");
            return -1;
        }
        unsigned oy = 0, ox = 0;
        size_t len = cut_segments(job->in, job->in_len, &job->grid, job->y0, job->y1, job->x0, job->x1, job->sub,
                                  &oy, &ox);
        if (len > 0) { /* else decode the whole input, which reports what is wrong with it */
            jpeg_abort_decompress(cinfo);
            jpeg_mem_src(cinfo, job->sub, (unsigned long)len);
            jpeg_read_header(cinfo, TRUE);
            configure(cinfo, job->denom, job->fast);
            job->top -= oy / (unsigned)job->denom;
            job->left -= ox / (unsigned)job->denom;
        }
    }
    jpeg_start_decompress(cinfo);
    JDIMENSION full_w = cinfo->output_width;
    /* Fancy (smooth) h2v1/h2v2 chroma upsampling treats the edges of a cropped region like
     * image edges (libjpeg.txt, "Partial image decompression"), which changes the region's
     * outermost columns. Ask for one more column on each side, so every column of the box is
     * interior to the region and the pixels equal a full decode's (at least 16 wide). */
    long x0, x1;
    widen(job->left, (long)job->left + job->width, 1, full_w, &x0, &x1);
    JDIMENSION xoff = (JDIMENSION)x0, xw = (JDIMENSION)(x1 - x0);
    if (xw < full_w)
        jpeg_crop_scanline(cinfo, &xoff, &xw); /* moves xoff left to an iMCU boundary */
    else
        xoff = 0;
    if (job->top > 0)
        jpeg_skip_scanlines(cinfo, job->top);
    if ((size_t)cinfo->output_width * 3 > job->stride) { /* the bound in decode_crop is wrong */
        strcpy(job->err.message, "libjpeg widened the crop beyond the output row");
        return -1;
    }
    job->offset = (size_t)(job->left - xoff) * 3;
    /* Rows go straight into the output, whole region width, many per call: reading one row
     * at a time into a scratch row and copying the box out measured 40% slower (libjpeg's
     * per-call upsampling and colour conversion work on fewer rows at once). The caller
     * views the box inside the region through a row stride. */
    const JDIMENSION end = job->top + job->height;
    JSAMPROW ptrs[32];
    while (cinfo->output_scanline < end) {
        JDIMENSION want = end - cinfo->output_scanline;
        if (want > 32)
            want = 32;
        unsigned char *base = job->out + (size_t)(cinfo->output_scanline - job->top) * job->stride;
        for (JDIMENSION r = 0; r < want; r++)
            ptrs[r] = base + r * job->stride;
        if (jpeg_read_scanlines(cinfo, ptrs, want) == 0) { /* cannot happen with a memory source */
            strcpy(job->err.message, "libjpeg returned no rows");
            return -1;
        }
    }
    /* The rows below the box are never decoded. */
    jpeg_abort_decompress(cinfo);
    return 0;
}

static PyObject *raise_jpeg(PyObject *type, const char *message)
{
    PyErr_SetString(type, message);
    return NULL;
}

PyDoc_STRVAR(decode_crop_doc,
"decode_crop(data, top=0, left=0, height=-1, width=-1, scale_denom=1, out=None, fast=False, segments=True)\n"
"-> (buffer, height, width, row_stride, offset)\n\n"
"Decode the box rows top..top+height, columns left..left+width of a JPEG scaled by\n"
"1/scale_denom (1, 2, 4 or 8; the scaled image is ceil(H/d) x ceil(W/d), as libjpeg\n"
"rounds) as packed RGB rows. A negative height or width runs to the image edge. The box\n"
"must lie inside the scaled image. Rows are decoded straight into `out` (a C-contiguous\n"
"writable buffer; ValueError names the bytes needed if it is too small) or a new bytearray,\n"
"region-wide: pixel (y, x, c) of the box is at offset + y*row_stride + x*3 + c. Returns the\n"
"buffer, the box size, row_stride and offset. height*(max(width+2, 16)+32)*3 bytes always suffice.\n"
"fast=True: fast integer IDCT and merged (non-smoothed) chroma upsampling.\n"
"segments=True: when the JPEG has a restart-segment grid, entropy-decode only the segments\n"
"covering the box (same pixels); False always decodes from the top (for comparisons).\n"
"Raises JpegError for corrupt data and Unsupported for CMYK/YCCK JPEGs.");

static PyObject *decode_crop(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"data", "top", "left", "height", "width", "scale_denom", "out", "fast", "segments", NULL};
    Py_buffer in = {0}, outview = {0};
    long top = 0, left = 0, height = -1, width = -1;
    int denom = 1, fast = 0, segments = 1;
    PyObject *out = Py_None, *result = NULL, *target = NULL;
    Job *job = NULL;
    int created = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|lllliOpp:decode_crop", kwlist, &in, &top, &left, &height,
                                     &width, &denom, &out, &fast, &segments))
        return NULL;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_Format(PyExc_ValueError, "scale_denom must be 1, 2, 4 or 8, got %d", denom);
        goto done;
    }
    if (top < 0 || left < 0) {
        PyErr_Format(PyExc_ValueError, "box top and left must be >= 0, got top=%ld left=%ld", top, left);
        goto done;
    }
    if (in.len == 0) {
        raise_jpeg(JpegError, "empty JPEG payload (0 bytes)");
        goto done;
    }
    job = PyMem_RawCalloc(1, sizeof(Job));
    if (job == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    j_decompress_ptr cinfo = &job->cinfo;
    cinfo->err = jpeg_std_error(&job->err.pub);
    job->err.pub.error_exit = error_exit;
    job->err.pub.emit_message = emit_message;
    jpeg_create_decompress(cinfo);
    created = 1;

    /* The header: a few microseconds, so with the GIL held. */
    if (setjmp(job->err.jump)) {
        raise_jpeg(JpegError, job->err.message);
        goto done;
    }
    jpeg_mem_src(cinfo, (const unsigned char *)in.buf, (unsigned long)in.len);
    jpeg_read_header(cinfo, TRUE);
    if (cinfo->jpeg_color_space != JCS_GRAYSCALE && cinfo->jpeg_color_space != JCS_YCbCr &&
        cinfo->jpeg_color_space != JCS_RGB) {
        PyErr_Format(Unsupported, "JPEG colour space %d (%d components) is not grayscale, YCbCr or RGB",
                     (int)cinfo->jpeg_color_space, cinfo->num_components);
        goto done;
    }
    configure(cinfo, denom, fast);
    if (cinfo->output_components != 3) {
        PyErr_Format(Unsupported, "libjpeg gives %d output components for RGB", cinfo->output_components);
        goto done;
    }
    const long W = (long)cinfo->output_width, H = (long)cinfo->output_height;
    if (height < 0)
        height = H - top;
    if (width < 0)
        width = W - left;
    if (height < 1 || width < 1 || top + height > H || left + width > W) {
        PyErr_Format(PyExc_ValueError,
                     "box (top=%ld, left=%ld, height=%ld, width=%ld) is not inside the %ldx%ld image "
                     "(scaled 1/%d)", top, left, height, width, H, W, denom);
        goto done;
    }
    job->top = (JDIMENSION)top;
    job->left = (JDIMENSION)left;
    job->height = (JDIMENSION)height;
    job->width = (JDIMENSION)width;
    job->denom = denom;
    job->fast = fast;
    if (segments && find_grid((const unsigned char *)in.buf, (size_t)in.len, &job->grid) &&
        job->grid.width == cinfo->image_width && job->grid.height == cinfo->image_height) {
        /* The scaled rows and columns to cover: the box, 2 more each side (fancy chroma
         * upsampling looks one chroma sample beyond a pixel, and treats the cut-out's edges
         * like image edges), at least 16 each way (as decode_box keeps the region). */
        long ys0, ys1, xs0, xs1;
        widen(top, top + height, 2, H, &ys0, &ys1);
        widen(left, left + width, 2, W, &xs0, &xs1);
        const Grid *g = &job->grid;
        job->y0 = (unsigned)(ys0 * denom);
        job->x0 = (unsigned)(xs0 * denom);
        job->y1 = (unsigned)(ys1 * denom) < g->height ? (unsigned)(ys1 * denom) : g->height;
        job->x1 = (unsigned)(xs1 * denom) < g->width ? (unsigned)(xs1 * denom) : g->width;
        const unsigned seg_w = g->interval * g->mcu_w;
        /* Worth it when segments above or beside the box can be left out (the plain path
         * never decodes the rows below it anyway). */
        job->use_grid = job->y0 >= g->mcu_h || job->x0 >= seg_w || job->x1 <= (g->mcus_per_row / g->interval - 1) * seg_w;
        job->in = (const unsigned char *)in.buf;
        job->in_len = (size_t)in.len;
    }
    /* The decoded region: the box, one column more on each side, its left edge moved back to
     * an iMCU boundary (at most one iMCU: max_h_samp_factor * DCT_scaled_size pixels). */
    long imcu = (long)cinfo->max_h_samp_factor * (long)cinfo->min_DCT_scaled_size;
    if (cinfo->num_components == 1 || imcu < 1)
        imcu = cinfo->min_DCT_scaled_size > 0 ? cinfo->min_DCT_scaled_size : 8;
    long region = (width + 2 > 16 ? width + 2 : 16) + imcu;
    if (region > W)
        region = W;
    job->stride = (size_t)region * 3;
    const Py_ssize_t need = (Py_ssize_t)height * (Py_ssize_t)job->stride;

    if (out == Py_None) {
        target = PyByteArray_FromStringAndSize(NULL, need);
        if (target == NULL)
            goto done;
    } else {
        Py_INCREF(out);
        target = out;
    }
    if (PyObject_GetBuffer(target, &outview, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (outview.len < need) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, the box needs %zd", outview.len, need);
        goto done;
    }
    job->out = (unsigned char *)outview.buf;

    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_box(job);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        raise_jpeg(JpegError, job->err.message);
        goto done;
    }
    result = Py_BuildValue("(Ollnn)", target, height, width, (Py_ssize_t)job->stride, (Py_ssize_t)job->offset);

done:
    if (outview.obj != NULL)
        PyBuffer_Release(&outview);
    Py_XDECREF(target);
    if (created)
        jpeg_destroy_decompress(&job->cinfo);
    if (job != NULL)
        free(job->sub);
    PyMem_RawFree(job);
    PyBuffer_Release(&in);
    return result;
}

PyDoc_STRVAR(header_doc,
"header(data) -> (height, width, components, colour_space)\n\n"
"The JPEG's full-size dimensions and libjpeg's J_COLOR_SPACE code, from its header only.");

static PyObject *header(PyObject *self, PyObject *args)
{
    Py_buffer in = {0};
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*:header", &in))
        return NULL;
    Job *job = PyMem_RawCalloc(1, sizeof(Job));
    if (job == NULL) {
        PyBuffer_Release(&in);
        return PyErr_NoMemory();
    }
    j_decompress_ptr cinfo = &job->cinfo;
    cinfo->err = jpeg_std_error(&job->err.pub);
    job->err.pub.error_exit = error_exit;
    job->err.pub.emit_message = emit_message;
    jpeg_create_decompress(cinfo);
    if (setjmp(job->err.jump)) {
        raise_jpeg(JpegError, job->err.message);
    } else if (in.len == 0) {
        raise_jpeg(JpegError, "empty JPEG payload (0 bytes)");
    } else {
        jpeg_mem_src(cinfo, (const unsigned char *)in.buf, (unsigned long)in.len);
        jpeg_read_header(cinfo, TRUE);
        result = Py_BuildValue("(IIii)", cinfo->image_height, cinfo->image_width, cinfo->num_components,
                               (int)cinfo->jpeg_color_space);
    }
    jpeg_destroy_decompress(cinfo);
    PyMem_RawFree(job);
    PyBuffer_Release(&in);
    return result;
}

PyDoc_STRVAR(restart_grid_doc,
"restart_grid(data) -> (interval, mcu_height, mcu_width, mcu_rows, mcus_per_row) or None\n\n"
"The restart-segment grid decode_crop cuts crops from (restart markers every `interval`\n"
"MCUs, dividing a row), from the markers before the scan; None when the JPEG has none.");

static PyObject *restart_grid(PyObject *self, PyObject *args)
{
    Py_buffer in = {0};
    Grid g;
    if (!PyArg_ParseTuple(args, "y*:restart_grid", &in))
        return NULL;
    int found = find_grid((const unsigned char *)in.buf, (size_t)in.len, &g);
    PyBuffer_Release(&in);
    if (!found)
        Py_RETURN_NONE;
    return Py_BuildValue("(IIIII)", g.interval, g.mcu_h, g.mcu_w, g.mcu_rows, g.mcus_per_row);
}

static PyMethodDef methods[] = {
    {"restart_grid", restart_grid, METH_VARARGS, restart_grid_doc},
    {"decode_crop", (PyCFunction)(void (*)(void))decode_crop, METH_VARARGS | METH_KEYWORDS, decode_crop_doc},
    {"header", header, METH_VARARGS, header_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._jpegcrop",
    "Cropped, DCT-downscaled JPEG decoding with libjpeg-turbo's partial decompression.", -1, methods,
};

PyMODINIT_FUNC PyInit__jpegcrop(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    JpegError = PyErr_NewExceptionWithDoc("fastload._jpegcrop.JpegError", "Corrupt or unreadable JPEG data.",
                                          PyExc_ValueError, NULL);
    Unsupported = PyErr_NewExceptionWithDoc("fastload._jpegcrop.Unsupported",
                                            "A valid JPEG this decoder does not handle (CMYK, YCCK).",
                                            PyExc_ValueError, NULL);
    if (JpegError == NULL || Unsupported == NULL || PyModule_AddObjectRef(m, "JpegError", JpegError) < 0 ||
        PyModule_AddObjectRef(m, "Unsupported", Unsupported) < 0 ||
        PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION", LIBJPEG_TURBO_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
