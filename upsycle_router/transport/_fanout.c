/* upsycle_router.transport._fanout: one buffer written to many connections' sockets in one call (optional;
 * upsycle_router/transport/accel.py has the Python equivalent and picks one; typed by _fanout.pyi beside this file).
 *
 * Theory of operation
 * -------------------
 * A group message for 1,000 subscribers is 1,000 writes of the same bytes. Through asyncio that is 1,000 method
 * calls into the connection and its transport, about as much CPU as the system calls themselves. fanout() takes
 * the driver's connections (a dict: id -> connection), the ids of a fan-out run and the run's framed bytes, and
 * for each connection whose `fd` attribute is a socket (>= 0: a Unix-socket connection whose transport buffers
 * nothing, so the bytes may bypass it without overtaking any) sends the bytes straight to the socket. It reads
 * every `fd` first, holding the GIL; sends with the GIL released (the verify threads run meanwhile); then, with
 * the GIL again, adds the bytes and messages to `written` and `messages_out` of each connection that took them
 * all. Every other connection of the run - no direct socket, a partial send, a full socket buffer, an error -
 * is returned with the number of bytes its socket took (0 if none): the caller hands it the rest through its
 * transport, which queues it, or meets the same error and closes the connection. The ids of the run that name
 * no connection (closed since the run was routed) are returned too, for the caller to give back.
 *
 * A group's next message usually goes to the same connections (the core hands the same `run` tuple while its
 * plan holds: core/state.py), and with 1,000 of them, looking each up and reading its `fd` is ~0.4 ms with the
 * caches cold - before the first send. So with a fifth argument, `epoch` (transport/connection.py: FD_EPOCH,
 * bumped whenever a connection's `fd` changes), the call keeps what it looked up - the connections and their
 * sockets - for the next call with the same run object, the same table and the same epoch, and sends straight
 * away then. It keeps one run (the last one whose every id named a connection), with a reference to each of its
 * connections until another run replaces it or forget() lets it go (the driver calls it whenever a connection
 * leaves its table: a closed connection is neither written to nor kept alive). One thread only: the kept run is
 * shared by every call and read while the GIL is released (the daemon calls it from its event loop).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/types.h>

typedef struct {
    PyObject *conn; /* strong reference */
    int fd;
    Py_ssize_t sent;
} target;

static PyObject *str_fd, *str_written, *str_messages_out;

/* The run kept (see the module comment): its targets own a reference to each connection. */
static PyObject *kept_run, *kept_conns;
static long long kept_epoch = -1;
static target *kept;
static Py_ssize_t kept_n, kept_direct;
enum { KEEP_MIN = 16 }; /* shorter runs are cheap to look up */

static void
keep_drop(void)
{
    target *t = kept;
    Py_ssize_t n = kept_n;
    kept = NULL;
    kept_n = kept_direct = 0;
    kept_epoch = -1;
    Py_CLEAR(kept_run);
    Py_CLEAR(kept_conns);
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(t[i].conn);
    PyMem_Free(t);
}

static int
add_to(PyObject *obj, PyObject *name, Py_ssize_t n)
{
    PyObject *old = PyObject_GetAttr(obj, name);
    if (old == NULL)
        return -1;
    PyObject *delta = PyLong_FromSsize_t(n);
    if (delta == NULL) {
        Py_DECREF(old);
        return -1;
    }
    PyObject *new = PyNumber_Add(old, delta);
    Py_DECREF(old);
    Py_DECREF(delta);
    if (new == NULL)
        return -1;
    int r = PyObject_SetAttr(obj, name, new);
    Py_DECREF(new);
    return r;
}

/* fanout(conns, run, data, nmsgs[, epoch]) -> ([(conn, sent), ...], [id, ...]): see the module comment. */
static PyObject *
fanout(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fanout(conns, run, data, nmsgs[, epoch]) takes 4 or 5 arguments");
        return NULL;
    }
    PyObject *conns = args[0], *run = args[1], *data = args[2];
    if (!PyDict_Check(conns) || !PyTuple_Check(run) || !PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "fanout takes a dict, a tuple of ids and bytes");
        return NULL;
    }
    Py_ssize_t nmsgs = PyLong_AsSsize_t(args[3]);
    if (nmsgs == -1 && PyErr_Occurred())
        return NULL;
    long long epoch = -1;
    if (nargs == 5) {
        epoch = PyLong_AsLongLong(args[4]);
        if (epoch == -1 && PyErr_Occurred())
            return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(run);
    const char *buf = PyBytes_AS_STRING(data);
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    PyObject *out = NULL, *gone = PyList_New(0), *result = NULL;
    if (gone == NULL)
        return NULL;
    Py_ssize_t k = 0; /* targets taken */
    Py_ssize_t direct = 0;
    target *t;
    int reused = epoch >= 0 && run == kept_run && conns == kept_conns && epoch == kept_epoch;
    if (reused) { /* the kept run: its connections and sockets as they were (the epoch says nothing changed) */
        t = kept;
        k = kept_n;
        direct = kept_direct;
        for (Py_ssize_t i = 0; i < k; i++)
            t[i].sent = 0;
        goto send;
    }
    t = PyMem_Calloc(n ? (size_t)n : 1, sizeof(target));
    if (t == NULL) {
        Py_DECREF(gone);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *conn = PyDict_GetItemWithError(conns, PyTuple_GET_ITEM(run, i)); /* borrowed */
        if (conn == NULL) {
            if (PyErr_Occurred() || PyList_Append(gone, PyTuple_GET_ITEM(run, i)) < 0)
                goto done;
            continue; /* closed meanwhile */
        }
        PyObject *fdobj = PyObject_GetAttr(conn, str_fd);
        if (fdobj == NULL)
            goto done;
        long fd = PyLong_AsLong(fdobj);
        Py_DECREF(fdobj);
        if (fd == -1 && PyErr_Occurred())
            goto done;
        Py_INCREF(conn);
        t[k].conn = conn;
        t[k].fd = fd >= 0 && fd <= 0x7fffffff ? (int)fd : -1;
        t[k].sent = 0;
        direct += t[k].fd >= 0;
        k++;
    }
send:
    if (direct && len) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < k; i++) {
            if (t[i].fd < 0)
                continue;
            ssize_t r;
            do
                r = send(t[i].fd, buf, (size_t)len, MSG_NOSIGNAL | MSG_DONTWAIT);
            while (r < 0 && errno == EINTR);
            t[i].sent = r > 0 ? (Py_ssize_t)r : 0;
        }
        Py_END_ALLOW_THREADS
    }
    out = PyList_New(0);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (t[i].fd >= 0 && t[i].sent == len) {
            if (add_to(t[i].conn, str_written, len) < 0 || add_to(t[i].conn, str_messages_out, nmsgs) < 0)
                goto done;
            continue;
        }
        PyObject *pair = Py_BuildValue("(On)", t[i].conn, t[i].sent);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
    }
    result = PyTuple_Pack(2, out, gone); /* (NULL if that fails: then nothing is returned) */
done:
    Py_XDECREF(out);
    if (!reused) {
        if (result != NULL && epoch >= 0 && k == n && n >= KEEP_MIN) { /* every id named a connection: kept */
            keep_drop();
            kept = t;
            kept_n = k;
            kept_direct = direct;
            kept_epoch = epoch;
            Py_INCREF(run);
            kept_run = run;
            Py_INCREF(conns);
            kept_conns = conns;
        }
        else {
            for (Py_ssize_t i = 0; i < k; i++)
                Py_DECREF(t[i].conn);
            PyMem_Free(t);
        }
    }
    Py_DECREF(gone);
    return result;
}

/* forget() -> None: let the kept run go (see the module comment). */
static PyObject *
forget(PyObject *self, PyObject *unused)
{
    keep_drop();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"forget", forget, METH_NOARGS, "forget() -> None: let the run kept by fanout() go, and its connections"},
    {"fanout", (PyCFunction)(void (*)(void))fanout, METH_FASTCALL,
     "fanout(conns, run, data, nmsgs[, epoch]) -> ([(conn, sent)], [id]): data sent to each direct socket of the run "
     "(GIL released); the others, and the ids that name no connection. With epoch, the run's connections and sockets "
     "are kept for the next call with the same run, table and epoch"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fanout", "One buffer to many sockets (see upsycle_router/transport/accel.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__fanout(void)
{
    str_fd = PyUnicode_InternFromString("fd");
    str_written = PyUnicode_InternFromString("written");
    str_messages_out = PyUnicode_InternFromString("messages_out");
    if (str_fd == NULL || str_written == NULL || str_messages_out == NULL)
        return NULL;
    return PyModule_Create(&module);
}
