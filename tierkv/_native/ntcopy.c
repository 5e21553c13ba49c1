/* tierkv._native._ntcopy: bulk copy into shared-memory slots with non-temporal stores.
 *
 * Why: glibc's memcpy switches to non-temporal stores only above ~3/4 of the LLC size (192 MiB on the
 * development machines), so copying one 2 MiB KV block at a time runs at ~0.6x of bulk memcpy: the
 * destination is read into the cache first and then evicted. Slots are written once and read by another
 * process later, so streaming stores that bypass the cache are the right tool. The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define TIERKV_HAVE_SSE2 1
#endif

#define NT_THRESHOLD (256 * 1024)

static void stream_copy(char *dst, const char *src, size_t n) {
#ifdef TIERKV_HAVE_SSE2
    if (n >= NT_THRESHOLD) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        size_t blocks = n / 64;
        for (size_t i = 0; i < blocks; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)(dst + 0), a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
            src += 64; dst += 64;
        }
        _mm_sfence();
        n -= blocks * 64;
    }
#endif
    memcpy(dst, src, n);
}

static PyObject *ntcopy_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    if (dst.len != src.len) {
        PyBuffer_Release(&dst); PyBuffer_Release(&src);
        PyErr_Format(PyExc_ValueError, "size mismatch: destination %zd bytes, source %zd bytes", dst.len, src.len);
        return NULL;
    }
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyBuffer_Release(&dst); PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "buffers must be C-contiguous");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst); PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* merge_planes(dst, planes): rebuild little-endian words from byte planes (most significant plane
 * first) in one pass; numpy needs one pass per plane plus shifts. */
static PyObject *ntcopy_merge_planes(PyObject *self, PyObject *args) {
    Py_buffer dst;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "w*O", &dst, &seq)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "planes must be a sequence");
    if (!fast) { PyBuffer_Release(&dst); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > 8 || dst.len % n != 0) {
        Py_DECREF(fast); PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "need 1..8 planes dividing the destination size");
        return NULL;
    }
    Py_buffer planes[8];
    Py_ssize_t got = 0, count = dst.len / n;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &planes[got], PyBUF_C_CONTIGUOUS) < 0) break;
        if (planes[got].len != count) {
            PyBuffer_Release(&planes[got]);
            PyErr_SetString(PyExc_ValueError, "every plane must hold one byte per word");
            break;
        }
    }
    if (got < n) {
        for (Py_ssize_t j = 0; j < got; j++) PyBuffer_Release(&planes[j]);
        Py_DECREF(fast); PyBuffer_Release(&dst);
        return NULL;
    }
    unsigned char *out = (unsigned char *)dst.buf;
    Py_BEGIN_ALLOW_THREADS
    if (n == 2) {
        const unsigned char *hi = planes[0].buf, *lo = planes[1].buf;
        uint16_t *w = (uint16_t *)out;  /* little-endian: low byte first */
        for (Py_ssize_t i = 0; i < count; i++) w[i] = (uint16_t)(((uint16_t)hi[i] << 8) | lo[i]);
    } else {
        for (Py_ssize_t j = 0; j < n; j++) {
            const unsigned char *p = planes[j].buf;
            Py_ssize_t at = n - 1 - j;
            for (Py_ssize_t i = 0; i < count; i++) out[i * n + at] = p[i];
        }
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) PyBuffer_Release(&planes[j]);
    Py_DECREF(fast);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", ntcopy_copy, METH_VARARGS, "copy(dst, src): copy equal-sized contiguous buffers with streaming stores."},
    {"merge_planes", ntcopy_merge_planes, METH_VARARGS, "merge_planes(dst, planes): words from byte planes, most significant first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ntcopy", "Streaming-store bulk copy.", -1, methods};

PyMODINIT_FUNC PyInit__ntcopy(void) { return PyModule_Create(&module); }
