/* The store's record layouts as its C code uses them (store/_records.c, store/_idindex.c).
 *
 * Theory of operation
 * -------------------
 * upsycle_router/store/layout.py owns the layouts of the LMDB tables; the numbers the C code needs are
 * repeated here as compile-time constants (no lookup per call). Each module that includes this header exports
 * them as the dict LAYOUT, under the names layout.py gives them; upsycle_router/store/accel.py uses a module
 * only if every one of them equals layout.py's (an extension built from older sources falls back to Python),
 * and tests/store/test_store_layout.py requires that they do.
 *
 *   msgs      seq -> expires_ms || flag (REC_GROUP: a group follows) [|| group] || id || data
 *   msg_exp   expires_ms || seq -> id
 *
 * Every number is a big-endian uint64, so that keys sort in number order.
 */
#ifndef UPSYCLE_STORE_LAYOUT_H
#define UPSYCLE_STORE_LAYOUT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define ID_LEN 32          /* a message id */
#define SEQ_LEN 8          /* a sequence number (the key of msgs), an expiry in ms */
#define REC_FLAG_AT 8      /* msgs record: the group flag, after expires_ms */
#define REC_GROUP 1        /* the flag of a record with a group */
#define REC_ID_AT 9        /* the id in a record without a group */
#define REC_ID_AT_GROUP 41 /* the id in a record with a group (after the 32-byte group) */
#define MSG_EXP_SEQ_AT 8   /* msg_exp key: the sequence number, after expires_ms */
#define MSG_EXP_KEY_LEN 16

static inline void
put_be64(char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (char)(v & 0xff);
}

static inline uint64_t
be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

/* module.LAYOUT = {name: value} of the constants above; 0, or -1 with an exception set. */
static inline int
add_layout(PyObject *m)
{
    PyObject *d = Py_BuildValue("{sisisisisisisisi}", "ID_LEN", ID_LEN, "SEQ_LEN", SEQ_LEN, "REC_FLAG_AT",
                                REC_FLAG_AT, "REC_GROUP", REC_GROUP, "REC_ID_AT", REC_ID_AT, "REC_ID_AT_GROUP",
                                REC_ID_AT_GROUP, "MSG_EXP_SEQ_AT", MSG_EXP_SEQ_AT, "MSG_EXP_KEY_LEN",
                                MSG_EXP_KEY_LEN);
    if (d == NULL)
        return -1;
    if (PyModule_AddObject(m, "LAYOUT", d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    return 0;
}

#endif /* UPSYCLE_STORE_LAYOUT_H */
