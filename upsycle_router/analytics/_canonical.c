/* Trace lines in the routers' canonical form cut into columns (see upsycle_router/analytics/canonical.py).
 *
 * scan(data, starts, ends) reads the lines data[starts[i]:ends[i]] (int64 offsets) against the one template
 * {"ts":V,"node":V,...,"role":V} (the fields of rules.RECORD_KINDS, in order) and returns (taken, fields):
 * taken holds 1 for each canonical line, 0 for the others; fields holds, per field, the values of the taken
 * lines as Arrow buffers: (offsets int32 n+1, bytes, valid 0/1 per row) for a string or number field (a
 * number's text: the caller casts it), (values 0/1, valid 0/1) for a boolean. None if the data is too large
 * for int32 offsets. The GIL is released while scanning. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define NFIELDS 13
#define MAX_NUMBER 24
#define MAX_DIGITS_LONG 18
/* Longest canonical line: far below Jackson's longest string (20,000,000 characters, StreamReadConstraints,
 * which Spark's parse keeps: a longer one makes the line not_json there). A longer line is the screen's. */
#define MAX_CANONICAL_LINE (1 << 20)

enum kind { STRING, DOUBLE, LONG, BOOLEAN };

static const char *names[NFIELDS] = {"ts", "node", "event", "id", "type", "group", "src", "dst", "peer",
                                     "size", "reason", "local", "role"};
static const enum kind kinds[NFIELDS] = {DOUBLE, STRING, STRING, STRING, STRING, STRING, STRING, STRING,
                                         STRING, LONG, STRING, BOOLEAN, STRING};

/* One line's fields: start offset and length of each value (-1: null; for a boolean, 1 or 0 as length of
 * "true" or "false" is not needed: start holds the value). */
typedef struct {
    uint32_t start;
    int32_t len;
} span;

/* Nonzero when some byte of w is c / is below 0x20 (bytes of w under 0x80: the caller checks that too). */
static inline uint64_t
has_byte(uint64_t w, unsigned char c)
{
    uint64_t x = w ^ (0x0101010101010101ULL * c);
    return (x - 0x0101010101010101ULL) & ~x & 0x8080808080808080ULL;
}

static inline uint64_t
has_less_than_space(uint64_t w)
{
    return (w - 0x2020202020202020ULL) & ~w & 0x8080808080808080ULL;
}

static int
is_digit(unsigned char c)
{
    return c >= '0' && c <= '9';
}

/* The value of the line at *p (before end) by kind; 0 if it is not canonical. */
static int
value(const unsigned char *d, Py_ssize_t *p, Py_ssize_t end, enum kind k, span *out)
{
    Py_ssize_t q = *p;
    if (end - q >= 4 && memcmp(d + q, "null", 4) == 0) {
        out->start = (uint32_t)q;
        out->len = -1;
        *p = q + 4;
        return 1;
    }
    if (k == STRING) {
        if (q >= end || d[q] != '"')
            return 0;
        Py_ssize_t r = q + 1;
        /* eight bytes at a time while none of them is a quote, a backslash, a control byte or not ASCII */
        while (r + 8 <= end) {
            uint64_t w;
            memcpy(&w, d + r, 8);
            if (has_byte(w, '"') | has_byte(w, '\\') | has_less_than_space(w) | (w & 0x8080808080808080ULL))
                break;
            r += 8;
        }
        while (r < end) {
            unsigned char c = d[r];
            if (c == '"')
                break;
            if (c < 0x20 || c >= 0x80 || c == '\\')
                return 0;
            r++;
        }
        if (r >= end)
            return 0;
        out->start = (uint32_t)(q + 1);
        out->len = (int32_t)(r - q - 1);
        *p = r + 1;
        return 1;
    }
    if (k == BOOLEAN) {
        if (end - q >= 4 && memcmp(d + q, "true", 4) == 0) {
            out->start = 1;
            out->len = 0;
            *p = q + 4;
            return 1;
        }
        if (end - q >= 5 && memcmp(d + q, "false", 5) == 0) {
            out->start = 0;
            out->len = 0;
            *p = q + 5;
            return 1;
        }
        return 0;
    }
    /* a number: -?(0|[1-9][0-9]*)(\.[0-9]+)? (the fraction only for a double) */
    Py_ssize_t r = q;
    if (r < end && d[r] == '-')
        r++;
    Py_ssize_t digits = r;
    if (r >= end || !is_digit(d[r]))
        return 0;
    if (d[r] == '0')
        r++;
    else
        while (r < end && is_digit(d[r]))
            r++;
    if (k == LONG) {
        if (r - digits > MAX_DIGITS_LONG)
            return 0;
    } else if (r < end && d[r] == '.') {
        r++;
        if (r >= end || !is_digit(d[r]))
            return 0;
        while (r < end && is_digit(d[r]))
            r++;
    } else if (r - q == 2 && d[q] == '-' && d[digits] == '0') {
        return 0; /* -0 as a double: Jackson reads an integer, and makes it 0.0, not -0.0 (the screen's) */
    }
    if (r - q > MAX_NUMBER)
        return 0;
    out->start = (uint32_t)q;
    out->len = (int32_t)(r - q);
    *p = r;
    return 1;
}

/* The fields of the line [s, e); 0 if it is not canonical. */
static int
line(const unsigned char *d, Py_ssize_t s, Py_ssize_t e, span *fields)
{
    Py_ssize_t p = s;
    if (e - s > MAX_CANONICAL_LINE)
        return 0;
    if (p >= e || d[p] != '{')
        return 0;
    p++;
    for (int i = 0; i < NFIELDS; i++) {
        if (i > 0) {
            if (p >= e || d[p] != ',')
                return 0;
            p++;
        }
        size_t n = strlen(names[i]);
        if (e - p < (Py_ssize_t)n + 3 || d[p] != '"' || memcmp(d + p + 1, names[i], n) != 0 || d[p + 1 + n] != '"'
            || d[p + 2 + n] != ':')
            return 0;
        p += (Py_ssize_t)n + 3;
        if (!value(d, &p, e, kinds[i], &fields[i]))
            return 0;
    }
    return p == e - 1 && d[p] == '}';
}

static PyObject *
scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "scan(data, starts, ends) takes 3 arguments");
        return NULL;
    }
    Py_buffer data, starts, ends;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &starts, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &ends, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&starts);
        return NULL;
    }
    PyObject *result = NULL;
    span *spans = NULL;
    if (starts.len != ends.len || starts.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "starts and ends must be int64 arrays of one length");
        goto done;
    }
    if (data.len > INT32_MAX) {
        Py_INCREF(Py_None);
        result = Py_None; /* offsets would not fit in int32: not this path's */
        goto done;
    }
    Py_ssize_t n = starts.len / 8;
    const int64_t *st = (const int64_t *)starts.buf, *en = (const int64_t *)ends.buf;
    const unsigned char *d = (const unsigned char *)data.buf;
    spans = PyMem_RawMalloc(sizeof(span) * NFIELDS * (size_t)(n ? n : 1));
    if (spans == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *taken_obj = PyBytes_FromStringAndSize(NULL, n);
    if (taken_obj == NULL)
        goto done;
    char *taken = PyBytes_AS_STRING(taken_obj);
    Py_ssize_t m = 0; /* lines taken */
    int64_t total[NFIELDS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = st[i], e = en[i];
        span *row = spans + m * NFIELDS;
        taken[i] = s >= 0 && e <= data.len && s < e && line(d, (Py_ssize_t)s, (Py_ssize_t)e, row);
        if (!taken[i])
            continue;
        for (int f = 0; f < NFIELDS; f++)
            if (row[f].len > 0)
                total[f] += row[f].len;
        m++;
    }
    Py_END_ALLOW_THREADS
    for (int f = 0; f < NFIELDS; f++)
        if (total[f] > INT32_MAX) {
            Py_DECREF(taken_obj);
            Py_INCREF(Py_None);
            result = Py_None;
            goto done;
        }
    PyObject *fields = PyList_New(NFIELDS);
    if (fields == NULL) {
        Py_DECREF(taken_obj);
        goto done;
    }
    result = Py_BuildValue("(NN)", taken_obj, fields);
    if (result == NULL)
        goto done;
    for (int f = 0; f < NFIELDS; f++) {
        PyObject *valid = PyBytes_FromStringAndSize(NULL, m);
        if (valid == NULL)
            goto fail;
        char *v = PyBytes_AS_STRING(valid);
        PyObject *item;
        if (kinds[f] == BOOLEAN) {
            PyObject *values = PyBytes_FromStringAndSize(NULL, m);
            if (values == NULL) {
                Py_DECREF(valid);
                goto fail;
            }
            char *b = PyBytes_AS_STRING(values);
            for (Py_ssize_t i = 0; i < m; i++) {
                const span *sp = &spans[i * NFIELDS + f];
                v[i] = sp->len >= 0;
                b[i] = sp->len >= 0 && sp->start;
            }
            item = Py_BuildValue("(NN)", values, valid);
        } else {
            PyObject *offsets = PyBytes_FromStringAndSize(NULL, (m + 1) * 4);
            PyObject *bytes = offsets ? PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total[f]) : NULL;
            if (bytes == NULL) {
                Py_XDECREF(offsets);
                Py_DECREF(valid);
                goto fail;
            }
            int32_t *o = (int32_t *)PyBytes_AS_STRING(offsets);
            char *out = PyBytes_AS_STRING(bytes);
            int32_t at = 0;
            for (Py_ssize_t i = 0; i < m; i++) {
                const span *sp = &spans[i * NFIELDS + f];
                o[i] = at;
                v[i] = sp->len >= 0;
                if (sp->len > 0) {
                    memcpy(out + at, d + sp->start, (size_t)sp->len);
                    at += sp->len;
                }
            }
            o[m] = at;
            item = Py_BuildValue("(NNN)", offsets, bytes, valid);
        }
        if (item == NULL)
            goto fail;
        PyList_SET_ITEM(fields, f, item);
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    PyMem_RawFree(spans);
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    return result;
}

static PyObject *
line_bounds(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *d = (const char *)data.buf, *end = d + data.len, *p;
    Py_ssize_t n = 0;
    Py_BEGIN_ALLOW_THREADS
    for (p = d; p < end && (p = memchr(p, '\n', (size_t)(end - p))) != NULL; p++)
        n++;
    Py_END_ALLOW_THREADS
    if (data.len > 0 && d[data.len - 1] != '\n')
        n++; /* the last line, without its newline */
    PyObject *starts = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *ends = starts ? PyBytes_FromStringAndSize(NULL, n * 8) : NULL;
    if (ends == NULL) {
        Py_XDECREF(starts);
        PyBuffer_Release(&data);
        return NULL;
    }
    int64_t *st = (int64_t *)PyBytes_AS_STRING(starts), *en = (int64_t *)PyBytes_AS_STRING(ends);
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t k = 0;
    int64_t start = 0;
    /* (k < n: a buffer changed by another thread between the two passes cannot make this write past them) */
    for (p = d; p < end && k < n && (p = memchr(p, '\n', (size_t)(end - p))) != NULL; p++) {
        st[k] = start;
        en[k++] = p - d;
        start = p - d + 1;
    }
    if (k < n) {
        st[k] = start;
        en[k] = data.len;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return Py_BuildValue("(NN)", starts, ends);
}

static PyObject *
field_names(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    PyObject *out = PyTuple_New(NFIELDS);
    if (out == NULL)
        return NULL;
    static const char *kind_names[] = {"string", "double", "long", "boolean"};
    for (int f = 0; f < NFIELDS; f++) {
        PyObject *pair = Py_BuildValue("(ss)", names[f], kind_names[kinds[f]]);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, f, pair);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(data, starts, ends) -> (taken, [per field: (offsets, bytes, valid) or (values, valid)]) or None: the "
     "lines data[starts[i]:ends[i]] in the canonical form (taken: 1 each), cut into columns (GIL released)"},
    {"lines", line_bounds, METH_O,
     "lines(data) -> (starts, ends): int64 offsets of each line of data (ends before its newline)"},
    {"fields", field_names, METH_NOARGS, "fields() -> ((name, kind), ...): the template's fields, in order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_canonical",
    "Canonical trace lines cut into columns (see upsycle_router/analytics/canonical.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__canonical(void)
{
    return PyModule_Create(&module);
}
