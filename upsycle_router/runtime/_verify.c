/* upsycle_router.runtime._verify: Ed25519 verification of many messages with the GIL released once (optional;
 * upsycle_router/runtime/accel.py has the Python equivalent and picks one; typed by _verify.pyi beside this file).
 *
 * Theory of operation
 * -------------------
 * libsodium releases the GIL, but a Python loop over messages takes it back after every signature, and on a
 * busy event loop that wait is longer than the verification. verify_batch() takes the GIL once per batch: it
 * collects pointers to (key, signed bytes, signature) of every message, reading the slots of the package's
 * Message values directly (_message.h, shared with the wire codec), releases the GIL, and calls libsodium's
 * crypto_sign_verify_detached for each. The function pointer comes from PyNaCl's own bundled libsodium (found
 * by upsycle_router/runtime/accel.py), so the verification is exactly PyNaCl's: crypto_sign_open, which PyNaCl
 * exposes, runs the same check on the same arguments.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_message.h"

#define MODULE "upsycle_router.runtime._verify"

typedef int (*verify_fn)(const unsigned char *sig, const unsigned char *m, unsigned long long mlen,
                         const unsigned char *pk);

typedef struct {
    const unsigned char *sig, *m, *pk;
    unsigned long long mlen;
    int ok; /* sizes right */
} vitem;

/* verify_batch(fn_address, messages, known=(), remember=None) -> bytes: one byte per message, 1 if its
 * signature verifies under its signer (src for unicast, grp for multicast), else 0. A message whose id is in
 * one of the sets in `known` counts as verified without verifying it again; the id of every message verified
 * here and found valid is added to the set `remember`. The GIL is released while verifying. */
static PyObject *
verify_batch(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    PyObject *seq, *known = NULL, *remember = Py_None;
    if (check_bound(MODULE) < 0 ||
        !PyArg_ParseTuple(args, "KO|O!O", &addr, &seq, &PyTuple_Type, &known, &remember))
        return NULL;
    if (addr == 0) {
        PyErr_SetString(PyExc_ValueError, "no verification function");
        return NULL;
    }
    if (remember != Py_None && !PySet_Check(remember)) {
        PyErr_SetString(PyExc_TypeError, "remember must be a set or None");
        return NULL;
    }
    Py_ssize_t nknown = known != NULL ? PyTuple_GET_SIZE(known) : 0;
    for (Py_ssize_t j = 0; j < nknown; j++)
        if (!PyAnySet_Check(PyTuple_GET_ITEM(known, j))) {
            PyErr_SetString(PyExc_TypeError, "known must be a tuple of sets");
            return NULL;
        }
    verify_fn fn = (verify_fn)(uintptr_t)addr;
    PyObject *fast = PySequence_Fast(seq, "messages must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **objs = PySequence_Fast_ITEMS(fast);
    vitem *v = PyMem_Calloc(n ? (size_t)n : 1, sizeof(vitem));
    PyObject **keep = PyMem_Calloc(n ? 3 * (size_t)n : 1, sizeof(PyObject *)); /* key, sig, signed */
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (v == NULL || keep == NULL || out == NULL) {
        if (out != NULL)
            PyErr_NoMemory();
        goto done;
    }
    unsigned char *res = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *msg = objs[i];
        res[i] = 0;
        if (Py_TYPE(msg) != Message_type) {
            PyErr_SetString(PyExc_TypeError, "verify_batch takes Message values");
            goto done;
        }
        if (nknown) {
            PyObject *mid = get_slot(msg, m_descr[M_ID]);
            if (mid == NULL)
                goto done;
            int hit = 0;
            for (Py_ssize_t j = 0; j < nknown && !hit; j++) {
                hit = PySet_Contains(PyTuple_GET_ITEM(known, j), mid);
                if (hit < 0) {
                    Py_DECREF(mid);
                    goto done;
                }
            }
            Py_DECREF(mid);
            if (hit) {
                res[i] = 1;
                continue;
            }
        }
        PyObject *h = get_slot(msg, m_descr[M_HEADER]);
        if (h == NULL)
            goto done;
        PyObject *key;
        if (Py_TYPE(h) == Multicast_type)
            key = get_slot(h, g_descr[G_GRP]);
        else if (Py_TYPE(h) == Unicast_type)
            key = get_slot(h, u_descr[U_SRC]);
        else {
            Py_DECREF(h);
            PyErr_SetString(PyExc_TypeError, "unknown header type");
            goto done;
        }
        Py_DECREF(h);
        keep[3 * i] = key;
        if (key == NULL)
            goto done;
        keep[3 * i + 1] = get_slot(msg, m_descr[M_SIG]);
        if (keep[3 * i + 1] == NULL)
            goto done;
        keep[3 * i + 2] = get_slot(msg, m_descr[M_SIGNED]);
        if (keep[3 * i + 2] == NULL)
            goto done;
        PyObject *sig = keep[3 * i + 1], *signed_ = keep[3 * i + 2];
        if (PyBytes_Check(key) && PyBytes_GET_SIZE(key) == PUBKEY_LEN && PyBytes_Check(sig) &&
            PyBytes_GET_SIZE(sig) == SIG_LEN && PyBytes_Check(signed_)) {
            v[i].pk = (const unsigned char *)PyBytes_AS_STRING(key);
            v[i].sig = (const unsigned char *)PyBytes_AS_STRING(sig);
            v[i].m = (const unsigned char *)PyBytes_AS_STRING(signed_);
            v[i].mlen = (unsigned long long)PyBytes_GET_SIZE(signed_);
            v[i].ok = 1;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (v[i].ok)
            res[i] = fn(v[i].sig, v[i].m, v[i].mlen, v[i].pk) == 0;
    Py_END_ALLOW_THREADS
    if (remember != Py_None)
        for (Py_ssize_t i = 0; i < n; i++)
            if (v[i].ok && res[i]) {
                PyObject *mid = get_slot(objs[i], m_descr[M_ID]);
                if (mid == NULL || PySet_Add(remember, mid) < 0) {
                    Py_XDECREF(mid);
                    goto done;
                }
                Py_DECREF(mid);
            }
done:
    if (keep != NULL) {
        for (Py_ssize_t i = 0; i < 3 * n; i++)
            Py_XDECREF(keep[i]);
        PyMem_Free(keep);
    }
    PyMem_Free(v);
    Py_DECREF(fast);
    if (PyErr_Occurred()) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}

/* verify_raw(fn_address, key, data, sig) -> bool: one signature (tests; the same call verify_batch makes) */
static PyObject *
verify_raw(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    Py_buffer k, d, s;
    if (!PyArg_ParseTuple(args, "Ky*y*y*", &addr, &k, &d, &s))
        return NULL;
    int ok = 0;
    if (addr != 0 && k.len == PUBKEY_LEN && s.len == SIG_LEN) {
        verify_fn fn = (verify_fn)(uintptr_t)addr;
        Py_BEGIN_ALLOW_THREADS
        ok = fn(s.buf, d.buf, (unsigned long long)d.len, k.buf) == 0;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&k);
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return PyBool_FromLong(ok);
}


static PyMethodDef methods[] = {
    BIND_METHOD,
    {"verify_batch", verify_batch, METH_VARARGS,
     "verify_batch(fn, messages, known=(), remember=None) -> bytes: 1 per valid signature (GIL released)"},
    {"verify_raw", verify_raw, METH_VARARGS, "verify_raw(fn, key, data, sig) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_verify", "Signatures verified in batches (see upsycle_router/runtime/accel.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__verify(void)
{
    return PyModule_Create(&module);
}
