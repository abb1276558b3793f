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

typedef struct {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    JDIMENSION top, left, height, width; /* the box, in scaled output pixels */
    size_t stride;                       /* bytes from one output row to the next */
    unsigned char *out;                  /* height * stride bytes */
    size_t offset;                       /* set by decode_box: bytes from out to the box's first pixel */
} Job;

/* Rows top..top+height, columns left..left+width of the scaled image into job->out.
 * Returns 0, or -1 with job->err.message set. No Python API in here: runs without the GIL. */
static int decode_box(Job *job)
{
    j_decompress_ptr cinfo = &job->cinfo;
    if (setjmp(job->err.jump))
        return -1;
    jpeg_start_decompress(cinfo);
    JDIMENSION full_w = cinfo->output_width;
    /* Fancy (smooth) h2v1/h2v2 chroma upsampling treats the edges of a cropped region like
     * image edges (libjpeg.txt, "Partial image decompression"), which changes the region's
     * outermost columns. Ask for one more column on each side, so every column of the box is
     * interior to the region and the pixels equal a full decode's. */
    JDIMENSION x0 = job->left > 0 ? job->left - 1 : 0;
    JDIMENSION x1 = job->left + job->width < full_w ? job->left + job->width + 1 : full_w;
    /* libjpeg picks plain (not fancy) upsampling for a component only 1-2 samples wide, so a
     * very narrow region would change pixels: keep it at least 16 columns wide. */
    if (x1 - x0 < 16) {
        x1 = x0 + 16 < full_w ? x0 + 16 : full_w;
        x0 = x1 > 16 ? x1 - 16 : 0;
    }
    JDIMENSION xoff = x0, xw = x1 - x0;
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
"decode_crop(data, top=0, left=0, height=-1, width=-1, scale_denom=1, out=None, fast=False)\n"
"-> (buffer, height, width, row_stride, offset)\n\n"
"Decode the box rows top..top+height, columns left..left+width of a JPEG scaled by\n"
"1/scale_denom (1, 2, 4 or 8; the scaled image is ceil(H/d) x ceil(W/d), as libjpeg\n"
"rounds) as packed RGB rows. A negative height or width runs to the image edge. The box\n"
"must lie inside the scaled image. Rows are decoded straight into `out` (a C-contiguous\n"
"writable buffer; ValueError names the bytes needed if it is too small) or a new bytearray,\n"
"region-wide: pixel (y, x, c) of the box is at offset + y*row_stride + x*3 + c. Returns the\n"
"buffer, the box size, row_stride and offset. height*(max(width+2, 16)+32)*3 bytes always suffice.\n"
"fast=True: fast integer IDCT and merged (non-smoothed) chroma upsampling.\n"
"Raises JpegError for corrupt data and Unsupported for CMYK/YCCK JPEGs.");

static PyObject *decode_crop(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"data", "top", "left", "height", "width", "scale_denom", "out", "fast", NULL};
    Py_buffer in = {0}, outview = {0};
    long top = 0, left = 0, height = -1, width = -1;
    int denom = 1, fast = 0;
    PyObject *out = Py_None, *result = NULL, *target = NULL;
    Job *job = NULL;
    int created = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|lllliOp:decode_crop", kwlist, &in, &top, &left, &height,
                                     &width, &denom, &out, &fast))
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
    cinfo->out_color_space = JCS_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)denom;
    /* fast: libjpeg-turbo's fast integer IDCT (FFCV's TJFLAG_FASTDCT) and merged chroma
     * upsampling (TJFLAG_FASTUPSAMPLE): ~10% less decode time, slightly different pixels. */
    cinfo->dct_method = fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo->do_fancy_upsampling = fast ? FALSE : TRUE;
    jpeg_calc_output_dimensions(cinfo);
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

static PyMethodDef methods[] = {
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
