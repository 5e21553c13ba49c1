/* tierkv._native._lookup: the shared lookup index, a hash set of cached block keys in a memfd.
 *
 * Why: lookup is the scheduler's hot path (asked for every waiting request at every step). Through the
 * socket it costs a round trip and ~20 us of the daemon's GIL per call; with several busy engine
 * processes on few cores its tail is set by scheduling, not by work. The daemon mirrors its block
 * table's key set into this table; clients map it read-only and answer `lookup` in a few microseconds
 * of their own CPU, touching no lock and no daemon thread.
 *
 * Layout (little-endian u64 words): header of 8 words, then `nslots` (a power of two) tag words.
 *   0 magic "TKVLKUP1"   1 nslots   2 seq (seqlock: odd while the daemon writes)   3 count
 *   4 flags (bit 0: overflow, the table is incomplete and clients must ask the daemon)
 * A key's tag is a 64-bit hash of fingerprint + key with bit 0 set (0 marks an empty slot); its home
 * slot is tag >> 8 masked, linear probing, deletion by backward shift (no tombstones). One writer (the
 * daemon, under its block-table lock); readers retry when the seqlock moved during their probe, and a
 * reader that cannot get a stable view returns -1 so the client asks the daemon instead.
 * Two keys whose 64-bit tags collide (chance ~n^2 / 2^65) can only make a lookup count one block too
 * many or too few: a lease then covers the blocks really there, as after any eviction race.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAGIC 0x3150554B4C564B54ULL /* "TKVLKUP1" little-endian */
#define HDR_WORDS 8
#define F_OVERFLOW 1ULL
#define MAX_FK 512
#define READ_TRIES 64

typedef struct {
    uint64_t magic, nslots, seq, count, flags, pad[3];
} header_t;

static inline uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* The hash of a || b, 8 bytes at a time (a = the 16-byte namespace fingerprint, b = the key). */
static uint64_t hash2(const unsigned char *a, size_t na, const unsigned char *b, size_t nb) {
    unsigned char buf[MAX_FK + 8];
    size_t n = na + nb, i;
    memcpy(buf, a, na);
    memcpy(buf + na, b, nb);
    memset(buf + n, 0, 8);
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    for (i = 0; i < n; i += 8)
        h = mix(h ^ rd64(buf + i)) + 0x632BE59BD9B4E019ULL;
    return mix(h) | 1ULL;
}

typedef struct {
    Py_buffer view;
    header_t *hdr;
    uint64_t *slots;
    uint64_t mask;
} table_t;

static int open_table(PyObject *obj, table_t *t, int writable) {
    if (PyObject_GetBuffer(obj, &t->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (t->view.len < (Py_ssize_t)(HDR_WORDS * 8) || ((uintptr_t)t->view.buf & 7)) {
        PyBuffer_Release(&t->view);
        PyErr_SetString(PyExc_ValueError, "not a lookup index (too small or misaligned)");
        return -1;
    }
    t->hdr = (header_t *)t->view.buf;
    uint64_t n = t->hdr->nslots;
    if (t->hdr->magic != MAGIC || n == 0 || (n & (n - 1)) ||
        (Py_ssize_t)((HDR_WORDS + n) * 8) > t->view.len) {
        PyBuffer_Release(&t->view);
        PyErr_SetString(PyExc_ValueError, "not a lookup index (bad header)");
        return -1;
    }
    t->slots = (uint64_t *)t->view.buf + HDR_WORDS;
    t->mask = n - 1;
    return 0;
}

static int fk_bytes(PyObject *o, const char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "keys must be bytes");
        return -1;
    }
    *p = PyBytes_AS_STRING(o);
    *n = PyBytes_GET_SIZE(o);
    if (*n < 1 || *n > MAX_FK) {
        PyErr_SetString(PyExc_ValueError, "key length out of range");
        return -1;
    }
    return 0;
}

/* Linear probe for ``tag`` from its home slot: 1 with *at = its slot, or 0 with *at = the empty slot that
 * ends its run (where an insert goes). A probe that meets no empty slot (only a reader's torn view of a
 * table being rewritten; the writer keeps a quarter empty) also answers 0. */
static inline int probe(const table_t *t, uint64_t tag, uint64_t *at) {
    uint64_t i = (tag >> 8) & t->mask;
    for (uint64_t probes = 0; probes <= t->mask; probes++) {
        uint64_t s = __atomic_load_n(&t->slots[i], __ATOMIC_RELAXED);
        if (s == tag || s == 0) {
            *at = i;
            return s == tag;
        }
        i = (i + 1) & t->mask;
    }
    *at = i;
    return 0;
}

static inline uint64_t key_tag(const char *p, Py_ssize_t n) {
    return hash2((const unsigned char *)p, (size_t)n, (const unsigned char *)"", 0);
}

static inline void write_begin(header_t *h) {
    __atomic_store_n(&h->seq, h->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void write_end(header_t *h) {
    __atomic_store_n(&h->seq, h->seq + 1, __ATOMIC_RELEASE);
}

static PyObject *py_init(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj))
        return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_WRITABLE) < 0)
        return NULL;
    uint64_t n = 1;
    while ((HDR_WORDS + n * 2) * 8 <= (uint64_t)v.len)
        n *= 2;
    if (v.len < (Py_ssize_t)((HDR_WORDS + 64) * 8) || ((uintptr_t)v.buf & 7)) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "buffer too small or misaligned for a lookup index");
        return NULL;
    }
    memset(v.buf, 0, (HDR_WORDS + n) * 8);
    header_t *h = (header_t *)v.buf;
    h->nslots = n;
    __atomic_store_n(&h->magic, MAGIC, __ATOMIC_RELEASE);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *py_clear(PyObject *self, PyObject *args) {
    PyObject *obj;
    table_t t;
    if (!PyArg_ParseTuple(args, "O", &obj) || open_table(obj, &t, 1) < 0)
        return NULL;
    write_begin(t.hdr);
    memset(t.slots, 0, (t.mask + 1) * 8);
    t.hdr->count = 0;
    t.hdr->flags = 0;
    write_end(t.hdr);
    PyBuffer_Release(&t.view);
    Py_RETURN_NONE;
}

/* insert(buf, fk) -> 1 added, 0 already there, -1 no room (the overflow flag is now set). */
static PyObject *py_insert(PyObject *self, PyObject *args) {
    PyObject *obj, *key;
    const char *p;
    Py_ssize_t n;
    table_t t;
    if (!PyArg_ParseTuple(args, "OO", &obj, &key) || fk_bytes(key, &p, &n) < 0 || open_table(obj, &t, 1) < 0)
        return NULL;
    uint64_t tag = key_tag(p, n), i;
    long r = probe(&t, tag, &i) ? 0 : 1;
    if (r == 1) {
        if ((t.hdr->count + 1) * 4 > (t.mask + 1) * 3) { /* load factor 3/4: probes stay short */
            write_begin(t.hdr);
            t.hdr->flags |= F_OVERFLOW;
            write_end(t.hdr);
            r = -1;
        } else {
            write_begin(t.hdr);
            __atomic_store_n(&t.slots[i], tag, __ATOMIC_RELAXED);
            t.hdr->count += 1;
            write_end(t.hdr);
        }
    }
    PyBuffer_Release(&t.view);
    return PyLong_FromLong(r);
}

/* remove(buf, fk) -> 1 removed, 0 absent. */
static PyObject *py_remove(PyObject *self, PyObject *args) {
    PyObject *obj, *key;
    const char *p;
    Py_ssize_t n;
    table_t t;
    if (!PyArg_ParseTuple(args, "OO", &obj, &key) || fk_bytes(key, &p, &n) < 0 || open_table(obj, &t, 1) < 0)
        return NULL;
    uint64_t i, m = t.mask;
    long r = probe(&t, key_tag(p, n), &i);
    if (r) {
        write_begin(t.hdr);
        /* Backward shift: move later entries of the run into the hole when their home allows it. */
        uint64_t j = i;
        for (;;) {
            j = (j + 1) & m;
            uint64_t s = t.slots[j];
            if (s == 0)
                break;
            uint64_t k = (s >> 8) & m;
            int movable = (i <= j) ? (k <= i || k > j) : (k <= i && k > j);
            if (movable) {
                __atomic_store_n(&t.slots[i], s, __ATOMIC_RELAXED);
                i = j;
            }
        }
        __atomic_store_n(&t.slots[i], 0, __ATOMIC_RELAXED);
        t.hdr->count -= 1;
        write_end(t.hdr);
    }
    PyBuffer_Release(&t.view);
    return PyLong_FromLong(r);
}

/* prefix(buf, fingerprint, keys) -> how many leading keys are in the table, or -1: ask the daemon
 * (the table overflowed, or it kept changing under this reader). The GIL is held: it takes microseconds. */
static PyObject *py_prefix(PyObject *self, PyObject *args) {
    PyObject *obj, *fp, *keys;
    const char *fpp;
    Py_ssize_t fpn;
    table_t t;
    if (!PyArg_ParseTuple(args, "OSO", &obj, &fp, &keys))
        return NULL;
    fpp = PyBytes_AS_STRING(fp);
    fpn = PyBytes_GET_SIZE(fp);
    if (fpn < 1 || fpn > 64) {
        PyErr_SetString(PyExc_ValueError, "fingerprint length out of range");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t a = 0; a < nk; a++) {
        if (!PyBytes_Check(items[a]) || PyBytes_GET_SIZE(items[a]) < 1 ||
            PyBytes_GET_SIZE(items[a]) + fpn > MAX_FK) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "each key must be non-empty bytes of bounded length");
            return NULL;
        }
    }
    if (open_table(obj, &t, 0) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    long result = -1;
    for (int attempt = 0; attempt < READ_TRIES && result < 0; attempt++) {
        uint64_t s1 = __atomic_load_n(&t.hdr->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1)
            continue;
        if (__atomic_load_n(&t.hdr->flags, __ATOMIC_RELAXED) & F_OVERFLOW)
            break;
        Py_ssize_t found = 0;
        for (; found < nk; found++) {
            uint64_t tag = hash2((const unsigned char *)fpp, (size_t)fpn,
                                 (const unsigned char *)PyBytes_AS_STRING(items[found]),
                                 (size_t)PyBytes_GET_SIZE(items[found]));
            uint64_t at;
            if (!probe(&t, tag, &at))
                break;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&t.hdr->seq, __ATOMIC_RELAXED) == s1)
            result = (long)found;
    }
    PyBuffer_Release(&t.view);
    Py_DECREF(seq);
    return PyLong_FromLong(result);
}

/* info(buf) -> (nslots, count, overflow) */
static PyObject *py_info(PyObject *self, PyObject *args) {
    PyObject *obj;
    table_t t;
    if (!PyArg_ParseTuple(args, "O", &obj) || open_table(obj, &t, 0) < 0)
        return NULL;
    PyObject *r = Py_BuildValue("(KKO)", (unsigned long long)(t.mask + 1), (unsigned long long)t.hdr->count,
                                (t.hdr->flags & F_OVERFLOW) ? Py_True : Py_False);
    PyBuffer_Release(&t.view);
    return r;
}

static PyMethodDef methods[] = {
    {"init", py_init, METH_VARARGS, "init(buf) -> slots: format an empty index filling buf."},
    {"clear", py_clear, METH_VARARGS, "clear(buf): empty the index and its overflow flag."},
    {"insert", py_insert, METH_VARARGS, "insert(buf, fk) -> 1 added, 0 present, -1 full (overflow set)."},
    {"remove", py_remove, METH_VARARGS, "remove(buf, fk) -> 1 removed, 0 absent."},
    {"prefix", py_prefix, METH_VARARGS,
     "prefix(buf, fingerprint, keys) -> leading keys present, or -1 (ask the daemon)."},
    {"info", py_info, METH_VARARGS, "info(buf) -> (slots, count, overflow)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lookup", "The shared lookup index.", -1, methods};

PyMODINIT_FUNC PyInit__lookup(void) { return PyModule_Create(&module); }
