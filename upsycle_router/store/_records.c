/* upsycle_router.store._records: the store's records of new messages, and its bulk index writes sorted, in C
 * (optional; upsycle_router/store/accel.py has the Python equivalents and picks one; typed by _records.pyi).
 *
 * Theory of operation
 * -------------------
 * Storing a run of messages (LmdbStore.put_new_messages) builds, per message, its `msgs` record and its
 * msg_exp entry: msgs_records() does that for the whole run in one call, in the layout of
 * upsycle_router/store/layout.py (its numbers: _layout.h). The store writes msg_exp in bulk, sorted by key:
 * sorted_items() sorts the entries held in memory as Python and LMDB order bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_layout.h"

/* sorted_items(d) -> list: the (key, value) pairs of a dict with bytes keys, sorted by key as Python (and
   LMDB) order bytes - memcmp, then length - for the store's bulk msg_exp writes (4,096 entries: 0.25-0.47 ms,
   against 0.22-1.1 ms for Python's sort, which gains only when they arrived in expiry order) */
typedef struct {
    uint64_t head; /* the first 8 bytes, big-endian (zero-padded): decides almost every comparison in place */
    const char *p;
    Py_ssize_t n;
    PyObject *k;
    PyObject *v;
} kv_t;

static int
kv_cmp(const void *a, const void *b)
{
    const kv_t *x = (const kv_t *)a, *y = (const kv_t *)b;
    if (x->head != y->head)
        return x->head < y->head ? -1 : 1;
    int c = memcmp(x->p, y->p, (size_t)(x->n < y->n ? x->n : y->n));
    if (c)
        return c;
    return (x->n > y->n) - (x->n < y->n);
}

static void
kv_release(kv_t *a, Py_ssize_t n)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_DECREF(a[j].k);
        Py_DECREF(a[j].v);
    }
    PyMem_Free(a);
}

static PyObject *
sorted_items(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyDict_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "sorted_items: a dict with bytes keys");
        return NULL;
    }
    Py_ssize_t n = PyDict_GET_SIZE(arg), pos = 0, i = 0;
    kv_t *a = PyMem_Malloc(sizeof(kv_t) * (size_t)(n ? n : 1));
    if (a == NULL)
        return PyErr_NoMemory();
    PyObject *k, *v;
    while (i < n && PyDict_Next(arg, &pos, &k, &v)) {
        if (!PyBytes_Check(k)) {
            kv_release(a, i);
            PyErr_SetString(PyExc_TypeError, "sorted_items: a dict with bytes keys");
            return NULL;
        }
        a[i].p = PyBytes_AS_STRING(k);
        a[i].n = PyBytes_GET_SIZE(k);
        a[i].head = 0;
        for (Py_ssize_t b = 0; b < 8; b++)
            a[i].head = (a[i].head << 8) | (b < a[i].n ? (unsigned char)a[i].p[b] : 0);
        Py_INCREF(k); /* (held: the allocations below may run code that changes the dict) */
        Py_INCREF(v);
        a[i].k = k;
        a[i].v = v;
        i++;
    }
    qsort(a, (size_t)i, sizeof(kv_t), kv_cmp);
    PyObject *out = PyList_New(i);
    if (out == NULL) {
        kv_release(a, i);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < i; j++) {
        PyObject *t = PyTuple_Pack(2, a[j].k, a[j].v);
        if (t == NULL) {
            kv_release(a, i);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, t);
    }
    kv_release(a, i);
    return out;
}

/* msgs_records(first_seq, head, messages, exps) -> (records, earliest): the store's `msgs` records of
   messages (id, data, expires) numbered from first_seq - (seq, expires_ms || head || id || data), seq and
   expires_ms big-endian, expires_ms = int(expires * 1000) (0 for expires <= 0) - with each message's msg_exp
   entry (expires_ms || seq -> id) added to the dict exps; earliest: the smallest expires_ms (2**64 - 1 for
   none). What LmdbStore.put_new_messages did in a Python loop, 0.9 us per message. */
static PyObject *
msgs_records(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long first;
    PyObject *head, *messages, *exps;
    if (!PyArg_ParseTuple(args, "KSOO!", &first, &head, &messages, &PyDict_Type, &exps))
        return NULL;
    PyObject *seq = PySequence_Fast(messages, "msgs_records: a sequence of (id, data, expires)");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), hn = PyBytes_GET_SIZE(head);
    PyObject *out = PyList_New(n);
    uint64_t earliest = UINT64_MAX;
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *mid, *data;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || !PyBytes_Check(mid = PyTuple_GET_ITEM(item, 0)) ||
            PyBytes_GET_SIZE(mid) != ID_LEN || !PyBytes_Check(data = PyTuple_GET_ITEM(item, 1))) {
            PyErr_SetString(PyExc_ValueError, "msgs_records: each message is (32-byte id, bytes, expires)");
            goto fail;
        }
        double e = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 2));
        if (e == -1.0 && PyErr_Occurred())
            goto fail;
        uint64_t ms = 0;
        if (e > 0) {
            double v = e * 1000.0;
            if (!(v < 18446744073709551616.0)) {
                PyErr_SetString(PyExc_OverflowError, "msgs_records: an expiry past 2**64 ms");
                goto fail;
            }
            ms = (uint64_t)v;
        }
        if (ms < earliest)
            earliest = ms;
        uint64_t sq = (uint64_t)first + (uint64_t)i;
        Py_ssize_t dn = PyBytes_GET_SIZE(data);
        PyObject *key = PyBytes_FromStringAndSize(NULL, SEQ_LEN);
        PyObject *rec = PyBytes_FromStringAndSize(NULL, REC_FLAG_AT + hn + ID_LEN + dn);
        PyObject *ek = PyBytes_FromStringAndSize(NULL, MSG_EXP_KEY_LEN);
        PyObject *pair = NULL;
        if (key != NULL && rec != NULL && ek != NULL) {
            put_be64(PyBytes_AS_STRING(key), sq);
            char *r = PyBytes_AS_STRING(rec);
            put_be64(r, ms); /* expires_ms || head || id || data */
            memcpy(r + REC_FLAG_AT, PyBytes_AS_STRING(head), (size_t)hn);
            memcpy(r + REC_FLAG_AT + hn, PyBytes_AS_STRING(mid), ID_LEN);
            memcpy(r + REC_FLAG_AT + hn + ID_LEN, PyBytes_AS_STRING(data), (size_t)dn);
            put_be64(PyBytes_AS_STRING(ek), ms); /* expires_ms || seq */
            put_be64(PyBytes_AS_STRING(ek) + MSG_EXP_SEQ_AT, sq);
            if (PyDict_SetItem(exps, ek, mid) == 0)
                pair = PyTuple_Pack(2, key, rec);
        }
        Py_XDECREF(key);
        Py_XDECREF(rec);
        Py_XDECREF(ek);
        if (pair == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, pair);
    }
    Py_DECREF(seq);
    PyObject *res = Py_BuildValue("(NK)", out, (unsigned long long)earliest);
    return res;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"sorted_items", sorted_items, METH_O, "sorted_items(d) -> list of (key, value), sorted by the bytes keys"},
    {"msgs_records", msgs_records, METH_VARARGS,
     "msgs_records(first_seq, head, messages, exps) -> (records, earliest): the store's records of new messages"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_records", "The store's records built in C (see upsycle_router/store/accel.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__records(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && add_layout(m) < 0)
        Py_CLEAR(m);
    return m;
}
