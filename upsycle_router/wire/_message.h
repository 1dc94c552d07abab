/* The package's message values (upsycle_router/wire/messages.py) as C sees them: shared by the extensions that
 * build or read Message, UnicastHeader and MulticastHeader values (wire/_codec.c, runtime/_verify.c).
 *
 * Theory of operation
 * -------------------
 * The three types are frozen dataclasses with __slots__: each field is a member descriptor of its class, and
 * C reads and writes a slot through that descriptor directly (tp_descr_get / tp_descr_set), without running
 * the dataclass' __init__ or its frozen __setattr__. Each extension module that includes this header has its
 * own copy of the types and descriptors below (everything here is static), filled in once by its bind()
 * function, which the module's Python side calls at import with the three types:
 * ``bind(Message, UnicastHeader, MulticastHeader)``. A field that is not a slot is refused there, so a change
 * to the dataclasses cannot go unnoticed.
 */
#ifndef UPSYCLE_MESSAGE_H
#define UPSYCLE_MESSAGE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define PUBKEY_LEN 32
#define SIG_LEN 64

/* Bound once from Python (bind()). */
static PyTypeObject *Message_type, *Unicast_type, *Multicast_type;
/* Member descriptors of the slots of the frozen dataclasses, set without running __init__/__setattr__. */
enum { M_HEADER, M_BODY, M_SIG, M_VIA, M_SIGNED, M_ID, M_WIRE, M_N };
static const char *message_fields[M_N] = {"header", "body", "sig", "via", "signed", "id", "wire"};
static PyObject *m_descr[M_N];
enum { U_SRC, U_DST, U_TTL, U_EXP, U_N };
static const char *unicast_fields[U_N] = {"src", "dst", "ttl", "exp"};
static PyObject *u_descr[U_N];
enum { G_GRP, G_TTL, G_EXP, G_SN, G_N };
static const char *multicast_fields[G_N] = {"grp", "ttl", "exp", "sn"};
static PyObject *g_descr[G_N];

static inline int
get_descrs(PyTypeObject *t, const char **names, PyObject **out, int n)
{
    for (int i = 0; i < n; i++) {
        PyObject *d = PyObject_GetAttrString((PyObject *)t, names[i]);
        if (d == NULL)
            return -1;
        if (Py_TYPE(d)->tp_descr_set == NULL || Py_TYPE(d)->tp_descr_get == NULL) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", t->tp_name, names[i]);
            Py_DECREF(d);
            return -1;
        }
        Py_XSETREF(out[i], d);
    }
    return 0;
}

/* bind(Message, UnicastHeader, MulticastHeader): the types to build and read */
static PyObject *
bind(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *m, *u, *g;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &m, &PyType_Type, &u, &PyType_Type, &g))
        return NULL;
    if (get_descrs((PyTypeObject *)m, message_fields, m_descr, M_N) < 0 ||
        get_descrs((PyTypeObject *)u, unicast_fields, u_descr, U_N) < 0 ||
        get_descrs((PyTypeObject *)g, multicast_fields, g_descr, G_N) < 0)
        return NULL;
    Py_INCREF(m); Py_XSETREF(Message_type, (PyTypeObject *)m);
    Py_INCREF(u); Py_XSETREF(Unicast_type, (PyTypeObject *)u);
    Py_INCREF(g); Py_XSETREF(Multicast_type, (PyTypeObject *)g);
    Py_RETURN_NONE;
}

#define BIND_METHOD \
    {"bind", bind, METH_VARARGS, "bind(Message, UnicastHeader, MulticastHeader): the types to build and read"}

static inline int
check_bound(const char *module)
{
    if (Message_type == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s: bind() was not called", module);
        return -1;
    }
    return 0;
}

/* Set a slot; steals the reference to v. */
static inline int
set_slot(PyObject *obj, PyObject *descr, PyObject *v)
{
    if (v == NULL)
        return -1;
    int r = Py_TYPE(descr)->tp_descr_set(descr, obj, v);
    Py_DECREF(v);
    return r;
}

/* A slot's value (a new reference), or NULL with an exception set (an unset slot). */
static inline PyObject *
get_slot(PyObject *obj, PyObject *descr)
{
    return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
}

#endif /* UPSYCLE_MESSAGE_H */
