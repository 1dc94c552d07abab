/* upsycle_router.store._idindex: the store's id index in memory, a C hash table (optional;
 * upsycle_router/store/accel.py has the Python equivalent and picks one; typed by _idindex.pyi beside this file).
 *
 * Theory of operation
 * -------------------
 * The store keeps no id index on disk: which sequence number a message id is stored under, and the duplicate
 * check of every message that arrives, is answered from memory (see upsycle_router/store/lmdb_store.py). When
 * the store opens, the index is filled from the msg_exp entries and the msgs records (add_pairs(), which reads
 * them in the layout of upsycle_router/store/layout.py: _layout.h); afterwards every stored and removed message
 * adds and discards its entry.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_layout.h"


/* IdIndex: where each stored message is, by id - a hash table of (fingerprint, sequence number) pairs, the
   store's whole id index in memory (16 bytes per slot, at most 70 % of the slots used). The fingerprint is a
   64-bit hash of the 32-byte id, salted per table, so nobody can aim ids at one slot or one fingerprint; two
   ids may still share a fingerprint, so a lookup returns every sequence number stored under it and the
   store compares the ids in those records. Open addressing with linear probing, removal by backward shift
   (no tombstones); sequence number 0 marks a free slot (the store numbers from 1). */
typedef struct {
    uint64_t fp;
    uint64_t seq;
} ide_t;

typedef struct {
    PyObject_HEAD
    ide_t *t;
    uint64_t mask; /* slots - 1 */
    uint64_t salt;
    int shift; /* 64 - the fingerprint's bits (tests use narrow fingerprints to make ids share them) */
    Py_ssize_t count;
} IdIndex;

#define IDX_MIN_SLOTS 4096

static inline uint64_t
mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t
idx_fp(const IdIndex *x, const unsigned char *p)
{
    uint64_t h = x->salt;
    for (int i = 0; i < ID_LEN; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = mix64(h ^ w);
    }
    return h >> x->shift;
}

static const unsigned char *
idx_id(PyObject *o)
{
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != ID_LEN) {
        PyErr_SetString(PyExc_ValueError, "IdIndex: ids are 32 bytes");
        return NULL;
    }
    return (const unsigned char *)PyBytes_AS_STRING(o);
}

/* Move every entry into a table of 2**bits slots. */
static int
idx_resize(IdIndex *x, int bits)
{
    uint64_t n = (uint64_t)1 << bits, mask = n - 1;
    ide_t *t = PyMem_Calloc((size_t)n, sizeof(ide_t));
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i <= x->mask; i++) {
        if (x->t[i].seq == 0)
            continue;
        uint64_t j = x->t[i].fp & mask;
        while (t[j].seq)
            j = (j + 1) & mask;
        t[j] = x->t[i];
    }
    PyMem_Free(x->t);
    x->t = t;
    x->mask = mask;
    return 0;
}

static int
idx_bits(uint64_t slots)
{
    int b = 0;
    while (((uint64_t)1 << b) < slots)
        b++;
    return b;
}

/* Add (fp, seq) unless it is there; 0, or -1 with an exception set (out of memory: nothing changed). */
static int
idx_insert(IdIndex *x, uint64_t fp, uint64_t seq)
{
    if (seq == 0) {
        PyErr_SetString(PyExc_ValueError, "IdIndex: sequence numbers start at 1");
        return -1;
    }
    if ((uint64_t)(x->count + 1) * 10 > (x->mask + 1) * 7 && idx_resize(x, idx_bits(x->mask + 1) + 1) < 0)
        return -1;
    uint64_t i = fp & x->mask;
    while (x->t[i].seq) {
        if (x->t[i].fp == fp && x->t[i].seq == seq)
            return 0;
        i = (i + 1) & x->mask;
    }
    x->t[i].fp = fp;
    x->t[i].seq = seq;
    x->count++;
    return 0;
}

static PyObject *
idx_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    unsigned long long salt;
    int fp_bits = 64;
    static char *kwlist[] = {"salt", "fp_bits", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "K|i", kwlist, &salt, &fp_bits))
        return NULL;
    if (fp_bits < 1 || fp_bits > 64) {
        PyErr_SetString(PyExc_ValueError, "IdIndex: fp_bits from 1 to 64");
        return NULL;
    }
    IdIndex *x = (IdIndex *)type->tp_alloc(type, 0);
    if (x == NULL)
        return NULL;
    x->t = PyMem_Calloc(IDX_MIN_SLOTS, sizeof(ide_t));
    if (x->t == NULL) {
        Py_DECREF(x);
        return PyErr_NoMemory();
    }
    x->mask = IDX_MIN_SLOTS - 1;
    x->salt = (uint64_t)salt;
    x->shift = 64 - fp_bits;
    x->count = 0;
    return (PyObject *)x;
}

static void
idx_dealloc(IdIndex *x)
{
    PyMem_Free(x->t);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

/* The (id, seq) arguments of add and discard: the id's fingerprint and seq; 0, or -1 with an exception set. */
static int
idx_args(IdIndex *x, PyObject *args, uint64_t *fp, uint64_t *seq)
{
    PyObject *id;
    unsigned long long s;
    if (!PyArg_ParseTuple(args, "OK", &id, &s))
        return -1;
    const unsigned char *p = idx_id(id);
    if (p == NULL)
        return -1;
    *fp = idx_fp(x, p);
    *seq = (uint64_t)s;
    return 0;
}

static PyObject *
idx_add(IdIndex *x, PyObject *args)
{
    uint64_t fp, seq;
    if (idx_args(x, args, &fp, &seq) < 0 || idx_insert(x, fp, seq) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Add the (key, value) pairs of an iterable: the sequence number is the 8 bytes of the key at seq_at (big-
   endian); the id is the value's 32 bytes at id_at, or - id_at -1, a `msgs` record - at REC_ID_AT_GROUP after
   a group (the byte at REC_FLAG_AT is REC_GROUP) and at REC_ID_AT without one. */
static PyObject *
idx_add_pairs(IdIndex *x, PyObject *args)
{
    PyObject *iterable;
    Py_ssize_t seq_at, id_at;
    if (!PyArg_ParseTuple(args, "Onn", &iterable, &seq_at, &id_at))
        return NULL;
    if (seq_at < 0 || id_at < -1) {
        PyErr_SetString(PyExc_ValueError, "IdIndex.add_pairs: offsets are positive (id_at -1: a record)");
        return NULL;
    }
    PyObject *it = PyObject_GetIter(iterable);
    if (it == NULL)
        return NULL;
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        PyObject *k, *v;
        int ok = 0;
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 && PyBytes_Check(k = PyTuple_GET_ITEM(item, 0)) &&
            PyBytes_Check(v = PyTuple_GET_ITEM(item, 1)) && PyBytes_GET_SIZE(k) >= seq_at + SEQ_LEN) {
            const unsigned char *kp = (const unsigned char *)PyBytes_AS_STRING(k);
            const unsigned char *vp = (const unsigned char *)PyBytes_AS_STRING(v);
            Py_ssize_t vn = PyBytes_GET_SIZE(v), at = id_at;
            if (at == -1)
                at = vn > REC_FLAG_AT && vp[REC_FLAG_AT] == REC_GROUP ? REC_ID_AT_GROUP : REC_ID_AT;
            if (vn >= at + ID_LEN && (id_at == -1 || vn == at + ID_LEN)) {
                ok = 1;
                if (idx_insert(x, idx_fp(x, vp + at), be64(kp + seq_at)) < 0) {
                    Py_DECREF(item);
                    Py_DECREF(it);
                    return NULL;
                }
            }
        }
        Py_DECREF(item);
        if (!ok) {
            Py_DECREF(it);
            PyErr_SetString(PyExc_ValueError, "IdIndex.add_pairs: an entry is not a (key, value) pair of bytes "
                                              "with a sequence number and an id where expected");
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* Append to `out` the sequence numbers stored under fp (as ints, or as (id, seq) pairs when id is given). */
static int
idx_collect(IdIndex *x, uint64_t fp, PyObject *id, PyObject *out)
{
    for (uint64_t i = fp & x->mask; x->t[i].seq; i = (i + 1) & x->mask) {
        if (x->t[i].fp != fp)
            continue;
        PyObject *s = PyLong_FromUnsignedLongLong(x->t[i].seq);
        if (s == NULL)
            return -1;
        PyObject *e = s;
        if (id != NULL) {
            e = PyTuple_Pack(2, id, s);
            Py_DECREF(s);
            if (e == NULL)
                return -1;
        }
        int r = PyList_Append(out, e);
        Py_DECREF(e);
        if (r < 0)
            return -1;
    }
    return 0;
}

static PyObject *
idx_find(IdIndex *x, PyObject *id)
{
    const unsigned char *p = idx_id(id);
    if (p == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out != NULL && idx_collect(x, idx_fp(x, p), NULL, out) < 0)
        Py_CLEAR(out);
    return out;
}

static PyObject *
idx_among(IdIndex *x, PyObject *ids)
{
    PyObject *seq = PySequence_Fast(ids, "IdIndex.among: a sequence of ids");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PySequence_Fast_GET_ITEM(seq, i);
        const unsigned char *p = idx_id(id);
        if (p == NULL || idx_collect(x, idx_fp(x, p), id, out) < 0) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *
idx_discard(IdIndex *x, PyObject *args)
{
    uint64_t fp, seq;
    if (idx_args(x, args, &fp, &seq) < 0)
        return NULL;
    uint64_t mask = x->mask, i = fp & mask;
    for (;; i = (i + 1) & mask) {
        if (x->t[i].seq == 0)
            Py_RETURN_FALSE;
        if (x->t[i].fp == fp && x->t[i].seq == seq)
            break;
    }
    /* Backward shift: pull each later entry of the run into the hole unless that would put it before its
       home slot. */
    for (uint64_t k = i;;) {
        x->t[i].seq = 0;
        for (;;) {
            k = (k + 1) & mask;
            if (x->t[k].seq == 0)
                goto removed;
            uint64_t home = x->t[k].fp & mask;
            if (((k - home) & mask) >= ((k - i) & mask))
                break;
        }
        x->t[i] = x->t[k];
        i = k;
    }
removed:
    x->count--;
    if ((uint64_t)x->count * 8 < mask + 1 && mask + 1 > IDX_MIN_SLOTS && idx_resize(x, idx_bits(mask + 1) - 1) < 0)
        PyErr_Clear(); /* (no memory for a smaller table: keep the large one) */
    Py_RETURN_TRUE;
}

static PyObject *
idx_clear(IdIndex *x, PyObject *unused)
{
    (void)unused;
    ide_t *t = PyMem_Calloc(IDX_MIN_SLOTS, sizeof(ide_t));
    if (t == NULL)
        return PyErr_NoMemory();
    PyMem_Free(x->t);
    x->t = t;
    x->mask = IDX_MIN_SLOTS - 1;
    x->count = 0;
    Py_RETURN_NONE;
}

static PyObject *
idx_nbytes(IdIndex *x, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong((x->mask + 1) * sizeof(ide_t));
}

static Py_ssize_t
idx_len(IdIndex *x)
{
    return x->count;
}

static PyMethodDef idx_methods[] = {
    {"add", (PyCFunction)idx_add, METH_VARARGS, "add(id, seq): the message id is stored under seq"},
    {"add_pairs", (PyCFunction)idx_add_pairs, METH_VARARGS,
     "add_pairs(pairs, seq_at, id_at): add each (key, value): seq in key[seq_at:], id in value[id_at:] "
     "(id_at -1: the value is a msgs record)"},
    {"find", (PyCFunction)idx_find, METH_O, "find(id) -> list of the sequence numbers it may be stored under"},
    {"among", (PyCFunction)idx_among, METH_O, "among(ids) -> list of (id, seq) for each seq an id may be under"},
    {"discard", (PyCFunction)idx_discard, METH_VARARGS, "discard(id, seq) -> bool: remove that entry if there"},
    {"clear", (PyCFunction)idx_clear, METH_NOARGS, "clear(): remove every entry"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef idx_getset[] = {
    {"nbytes", (getter)idx_nbytes, NULL, "the table's size in bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods idx_as_sequence = {
    .sq_length = (lenfunc)idx_len,
};

static PyTypeObject IdIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "upsycle_router.store._idindex.IdIndex",
    .tp_basicsize = sizeof(IdIndex),
    .tp_dealloc = (destructor)idx_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "IdIndex(salt, fp_bits=64): message id -> sequence numbers it may be stored under (fingerprints in "
              "memory)",
    .tp_methods = idx_methods,
    .tp_getset = idx_getset,
    .tp_as_sequence = &idx_as_sequence,
    .tp_new = idx_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_idindex", "The store's id index in C (see upsycle_router/store/accel.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__idindex(void)
{
    if (PyType_Ready(&IdIndexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&IdIndexType);
    if (PyModule_AddObject(m, "IdIndex", (PyObject *)&IdIndexType) < 0) {
        Py_DECREF(&IdIndexType);
        Py_DECREF(m);
        return NULL;
    }
    if (add_layout(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
