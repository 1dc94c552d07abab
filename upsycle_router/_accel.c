/* upsycle_router._accel: the router's hot path in C (optional; upsycle_router/accel.py has the Python
 * equivalents and picks one).
 *
 * Theory of operation
 * -------------------
 * Two things cost the event loop and the verify threads most per message when written in Python:
 *
 * 1. Cutting frames out of a stream and decoding the routed message in each. parse_frames() walks the 4-byte
 *    length prefixes (PROTOCOL.md section 5) of a receive buffer and decodes every frame that holds a routed
 *    message in its one deterministic encoding (PROTOCOL.md section 3) straight into the package's own frozen
 *    values (Message, UnicastHeader, MulticastHeader), without running their Python __init__. The message id
 *    is BLAKE3 over the frame slice `enc(TYPE) || enc(HEADER) || enc(BODY) || enc(SIG)`: no copy, no
 *    re-encoding. The ids of all the messages one call decodes are computed together at the end, with the
 *    official C implementation of BLAKE3 (vendor/blake3): the first 1 KiB chunks of messages longer than one
 *    chunk go through blake3_hash_many side by side (up to 16 in the SIMD lanes of one core), and only each
 *    message's rest is hashed on its own. For a 1.2 KiB message that is a third of the cost of hashing it
 *    alone, and it spares the call into the blake3 package. Any other frame (a session frame, a message
 *    not in deterministic form, garbage) is returned as its payload bytes for the strict Python decoder, which
 *    names the offending field. The accepted form is exactly the one upsycle_router/wire/messages.py's
 *    _decode_canonical accepts; tests/test_accel.py checks that both ways.
 *
 * 2. Ed25519 verification. libsodium releases the GIL, but a Python loop over messages takes it back after
 *    every signature, and on a busy event loop that wait is longer than the verification. verify_batch()
 *    takes the GIL once per batch: it collects pointers to (key, signed bytes, signature) of every message,
 *    releases the GIL, and calls libsodium's crypto_sign_verify_detached for each. The function pointer
 *    comes from PyNaCl's own bundled libsodium (found by upsycle_router/accel.py), so the verification is
 *    exactly PyNaCl's: crypto_sign_open, which PyNaCl exposes, runs the same check on the same arguments.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blake3.h"
#include "blake3_impl.h" /* blake3_hash_many, IV, CHUNK_START, CHUNK_END */

#define PUBKEY_LEN 32
#define SIG_LEN 64

typedef int (*verify_fn)(const unsigned char *sig, const unsigned char *m, unsigned long long mlen,
                         const unsigned char *pk);

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

static int
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

static PyObject *
bind(PyObject *self, PyObject *args)
{
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

/* Set a slot; steals the reference to v. */
static int
set_slot(PyObject *obj, PyObject *descr, PyObject *v)
{
    if (v == NULL)
        return -1;
    int r = Py_TYPE(descr)->tp_descr_set(descr, obj, v);
    Py_DECREF(v);
    return r;
}

static PyObject *
get_slot_raw(PyObject *obj, PyObject *descr)
{
    return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
}

static PyObject *
new_instance(PyTypeObject *t)
{
    return t->tp_alloc(t, 0);
}

/* ---------------------------------------------------------------- the deterministic form */

typedef struct {
    const unsigned char *p; /* frame payload */
    Py_ssize_t n;           /* its length */
    Py_ssize_t i;           /* read position */
} reader;

static int
lit(reader *r, const char *s, Py_ssize_t k)
{
    if (r->n - r->i < k || memcmp(r->p + r->i, s, (size_t)k) != 0)
        return 0;
    r->i += k;
    return 1;
}

/* A head of major type `major` (0 uint, 2 bstr) with an argument that fits 32 bits, in shortest form. */
static int
head32(reader *r, int major, uint64_t *out)
{
    if (r->i >= r->n)
        return 0;
    unsigned char b = r->p[r->i];
    if ((b >> 5) != major)
        return 0;
    unsigned char ai = b & 0x1f;
    const unsigned char *q = r->p + r->i + 1;
    Py_ssize_t left = r->n - r->i - 1;
    if (ai < 24) {
        *out = ai;
        r->i += 1;
        return 1;
    }
    if (ai == 24) {
        if (left < 1 || q[0] < 24)
            return 0;
        *out = q[0];
        r->i += 2;
        return 1;
    }
    if (ai == 25) {
        if (left < 2 || q[0] == 0)
            return 0;
        *out = ((uint64_t)q[0] << 8) | q[1];
        r->i += 3;
        return 1;
    }
    if (ai == 26) {
        if (left < 4 || (q[0] == 0 && q[1] == 0))
            return 0;
        *out = ((uint64_t)q[0] << 24) | ((uint64_t)q[1] << 16) | ((uint64_t)q[2] << 8) | q[3];
        r->i += 5;
        return 1;
    }
    return 0;
}

/* enc(bstr of 32 bytes) */
static int
key32(reader *r, const unsigned char **out)
{
    if (r->n - r->i < 34 || r->p[r->i] != 0x58 || r->p[r->i + 1] != 0x20)
        return 0;
    *out = r->p + r->i + 2;
    r->i += 34;
    return 1;
}

static PyObject *
bytes_at(const unsigned char *p, Py_ssize_t n)
{
    return PyBytes_FromStringAndSize((const char *)p, n);
}

/* ---------------------------------------------------------------- BLAKE3 of many inputs */

#define ID_LEN BLAKE3_OUT_LEN
#define HASH_GROUP 64 /* inputs per blake3_hash_many call (stack arrays) */
/* blake3_hash_many's AVX2 and AVX-512 code may read up to 48 bytes past an input's chunk (harmless where its
 * inputs are consecutive chunks of one buffer, as upstream uses it): an input with fewer than this many bytes
 * after its first chunk is hashed from a padded copy of that chunk, so nothing is read outside the input. */
#define HASH_TAIL_SLACK 64

static void
blake3_one(const unsigned char *in, size_t len, unsigned char out[ID_LEN])
{
    blake3_hasher h;
    blake3_hasher_init(&h);
    blake3_hasher_update(&h, in, len);
    blake3_hasher_finalize(&h, out, ID_LEN);
}

/* out[i] = BLAKE3-256(ins[i][0 : lens[i]]) for i < n; the same as blake3_one of each.
 *
 * An input longer than one chunk (1024 bytes) has a first chunk that is a leaf of its hash tree, with
 * counter 0 and the key IV, whatever else the input holds: the first chunks of up to HASH_GROUP such inputs
 * go through blake3_hash_many together, which fills the SIMD lanes with different inputs. Each input's hasher
 * then starts where blake3_hasher_update leaves one that has taken exactly a first full chunk and is given
 * more: that chunk's chaining value on the stack, the chunk counter at 1, an empty chunk state. The rest of
 * the input goes through the hasher as usual. Inputs of one chunk or less are hashed alone (their only chunk
 * is the root, finished differently). Each input is read within its bounds only (HASH_TAIL_SLACK). */
static void
blake3_many(const unsigned char *const *ins, const size_t *lens, size_t n, unsigned char *out)
{
    /* (static: only called with the GIL held, and the GIL is not released in here) */
    static uint8_t padded[HASH_GROUP][BLAKE3_CHUNK_LEN + HASH_TAIL_SLACK];
    const uint8_t *group[HASH_GROUP];
    size_t which[HASH_GROUP];
    uint8_t cvs[HASH_GROUP * ID_LEN];
    size_t i = 0;
    while (i < n) {
        size_t g = 0;
        for (; i < n && g < HASH_GROUP; i++) {
            if (lens[i] > BLAKE3_CHUNK_LEN) {
                if (lens[i] - BLAKE3_CHUNK_LEN >= HASH_TAIL_SLACK) {
                    group[g] = ins[i];
                } else {
                    memcpy(padded[g], ins[i], BLAKE3_CHUNK_LEN);
                    group[g] = padded[g];
                }
                which[g++] = i;
            } else {
                blake3_one(ins[i], lens[i], out + i * ID_LEN);
            }
        }
        if (g == 0)
            continue;
        blake3_hash_many(group, g, BLAKE3_CHUNK_LEN / BLAKE3_BLOCK_LEN, IV, 0, false, 0, CHUNK_START, CHUNK_END,
                         cvs);
        for (size_t j = 0; j < g; j++) {
            size_t k = which[j];
            blake3_hasher h;
            blake3_hasher_init(&h);
            memcpy(h.cv_stack, cvs + j * ID_LEN, ID_LEN);
            h.cv_stack_len = 1;
            h.chunk.chunk_counter = 1;
            blake3_hasher_update(&h, ins[k] + BLAKE3_CHUNK_LEN, lens[k] - BLAKE3_CHUNK_LEN);
            blake3_hasher_finalize(&h, out + k * ID_LEN, ID_LEN);
        }
    }
}

/* blake3_many(inputs) -> list of 32-byte digests (for the tests: the batch path against the blake3 package) */
static PyObject *
blake3_many_py(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "blake3_many() takes a sequence of bytes-like objects");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *bufs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    const unsigned char **ins = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(*ins));
    size_t *lens = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(*lens));
    unsigned char *out = PyMem_Malloc((n ? (size_t)n : 1) * ID_LEN);
    PyObject *res = NULL;
    Py_ssize_t got = 0;
    if (bufs == NULL || ins == NULL || lens == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &bufs[got], PyBUF_SIMPLE) < 0)
            goto done;
        ins[got] = (const unsigned char *)bufs[got].buf;
        lens[got] = (size_t)bufs[got].len;
    }
    blake3_many(ins, lens, (size_t)n, out);
    res = PyList_New(n);
    if (res == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)out + i * ID_LEN, ID_LEN);
        if (d == NULL) {
            Py_CLEAR(res);
            goto done;
        }
        PyList_SET_ITEM(res, i, d);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(ins);
    PyMem_Free(lens);
    PyMem_Free(out);
    Py_DECREF(seq);
    return res;
}

/* Decode one payload in the deterministic form into a Message. Returns a new reference, Py_None (new
 * reference) when the payload is not in that form, or NULL with an exception set (memory).
 *
 * With `id_len` NULL the message id is computed here. Otherwise the id slot is left unset for the caller,
 * who hashes the `*id_len` bytes from p + 1 (see parse_frames). */
static PyObject *
decode_canonical(const unsigned char *p, Py_ssize_t n, Py_ssize_t *id_len)
{
    reader r = {p, n, 0};
    if (n < 3 || (p[0] != 0x84 && p[0] != 0x85) || p[2] != 0xa4)
        Py_RETURN_NONE;
    int has_via = p[0] == 0x85;
    int multicast;
    const unsigned char *k1 = NULL, *k2 = NULL, *sn[16];
    uint64_t ttl, exp, nsn = 0, blen;
    if (p[1] == 0x00) {
        multicast = 0;
        r.i = 3;
        if (!(lit(&r, "\x63" "dst", 4) && key32(&r, &k2) && lit(&r, "\x63" "exp", 4) && head32(&r, 0, &exp) &&
              lit(&r, "\x63" "src", 4) && key32(&r, &k1) && lit(&r, "\x63" "ttl", 4) && head32(&r, 0, &ttl)))
            Py_RETURN_NONE;
    } else if (p[1] == 0x01) {
        multicast = 1;
        r.i = 3;
        if (!lit(&r, "\x62" "sn", 3) || r.i >= n)
            Py_RETURN_NONE;
        unsigned char a = p[r.i];
        if (a < 0x80 || a > 0x90)
            Py_RETURN_NONE;
        nsn = a - 0x80;
        r.i += 1;
        for (uint64_t j = 0; j < nsn; j++)
            if (!key32(&r, &sn[j]))
                Py_RETURN_NONE;
        if (!(lit(&r, "\x63" "exp", 4) && head32(&r, 0, &exp) && lit(&r, "\x63" "grp", 4) && key32(&r, &k1) &&
              lit(&r, "\x63" "ttl", 4) && head32(&r, 0, &ttl)))
            Py_RETURN_NONE;
    } else {
        Py_RETURN_NONE;
    }
    if (!head32(&r, 2, &blen))
        Py_RETURN_NONE;
    Py_ssize_t body_at = r.i;
    Py_ssize_t end = n - (has_via ? 34 : 0);
    /* body, then enc(SIG) ends exactly where VIA (or the frame) begins */
    if ((uint64_t)(end - body_at) != blen + 66 || end - body_at < 66)
        Py_RETURN_NONE;
    Py_ssize_t sig_at = body_at + (Py_ssize_t)blen;
    if (p[sig_at] != 0x58 || p[sig_at + 1] != 0x40)
        Py_RETURN_NONE;
    if (has_via && (p[end] != 0x58 || p[end + 1] != 0x20))
        Py_RETURN_NONE;

    PyObject *header = NULL, *msg = NULL, *sntuple = NULL;
    if (multicast) {
        header = new_instance(Multicast_type);
        if (header == NULL)
            return NULL;
        sntuple = PyTuple_New((Py_ssize_t)nsn);
        if (sntuple == NULL)
            goto fail;
        for (uint64_t j = 0; j < nsn; j++) {
            PyObject *b = bytes_at(sn[j], 32);
            if (b == NULL)
                goto fail;
            PyTuple_SET_ITEM(sntuple, (Py_ssize_t)j, b);
        }
        if (set_slot(header, g_descr[G_GRP], bytes_at(k1, 32)) < 0 ||
            set_slot(header, g_descr[G_TTL], PyLong_FromUnsignedLongLong(ttl)) < 0 ||
            set_slot(header, g_descr[G_EXP], PyLong_FromUnsignedLongLong(exp)) < 0)
            goto fail;
        int rc = Py_TYPE(g_descr[G_SN])->tp_descr_set(g_descr[G_SN], header, sntuple);
        Py_CLEAR(sntuple);
        if (rc < 0)
            goto fail;
    } else {
        header = new_instance(Unicast_type);
        if (header == NULL)
            return NULL;
        if (set_slot(header, u_descr[U_SRC], bytes_at(k1, 32)) < 0 ||
            set_slot(header, u_descr[U_DST], bytes_at(k2, 32)) < 0 ||
            set_slot(header, u_descr[U_TTL], PyLong_FromUnsignedLongLong(ttl)) < 0 ||
            set_slot(header, u_descr[U_EXP], PyLong_FromUnsignedLongLong(exp)) < 0)
            goto fail;
    }
    msg = new_instance(Message_type);
    if (msg == NULL)
        goto fail;
    if (Py_TYPE(m_descr[M_HEADER])->tp_descr_set(m_descr[M_HEADER], msg, header) < 0)
        goto fail;
    Py_CLEAR(header);
    if (set_slot(msg, m_descr[M_BODY], bytes_at(p + body_at, (Py_ssize_t)blen)) < 0 ||
        set_slot(msg, m_descr[M_SIG], bytes_at(p + sig_at + 2, SIG_LEN)) < 0 ||
        set_slot(msg, m_descr[M_SIGNED], bytes_at(p + 1, sig_at - 1)) < 0 ||
        set_slot(msg, m_descr[M_WIRE], bytes_at(p, n)) < 0)
        goto fail;
    if (id_len != NULL) {
        *id_len = end - 1;
    } else {
        unsigned char id[ID_LEN];
        blake3_one(p + 1, (size_t)(end - 1), id);
        if (set_slot(msg, m_descr[M_ID], bytes_at(id, ID_LEN)) < 0)
            goto fail;
    }
    if (has_via) {
        if (set_slot(msg, m_descr[M_VIA], bytes_at(p + end + 2, 32)) < 0)
            goto fail;
    } else {
        Py_INCREF(Py_None);
        if (set_slot(msg, m_descr[M_VIA], Py_None) < 0)
            goto fail;
    }
    /* The message and its header hold bytes, ints, None and a tuple of bytes: they can never be part of a
     * reference cycle, so the cyclic garbage collector need not walk them (CPython untracks such tuples for
     * the same reason). Thousands are in flight at full load; walking them cost ~0.7 us per message. */
    PyObject_GC_UnTrack(msg);
    {
        PyObject *h = get_slot_raw(msg, m_descr[M_HEADER]);
        if (h != NULL) {
            if (multicast) {
                PyObject *t = get_slot_raw(h, g_descr[G_SN]);
                if (t != NULL) {
                    PyObject_GC_UnTrack(t);
                    Py_DECREF(t);
                }
            }
            PyObject_GC_UnTrack(h);
            Py_DECREF(h);
        } else {
            PyErr_Clear();
        }
    }
    return msg;
fail:
    Py_XDECREF(sntuple);
    Py_XDECREF(header);
    Py_XDECREF(msg);
    return NULL;
}

static int
check_bound(void)
{
    if (Message_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "upsycle_router._accel: bind() was not called");
        return -1;
    }
    return 0;
}

/* decode(payload) -> Message | None */
static PyObject *
decode(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    if (check_bound() < 0 || PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *r = decode_canonical((const unsigned char *)b.buf, b.len, NULL);
    PyBuffer_Release(&b);
    return r;
}

/* parse_frames(buf, max_frame) -> (items, consumed, bad_length)
 *
 * Every complete frame at the start of `buf`, in order: a Message where the payload is a routed message in
 * deterministic form, else the payload as bytes. `consumed` is how many bytes of `buf` those frames took.
 * `bad_length` is the length field of the first frame whose length is 0 or over `max_frame` (-1 if none):
 * nothing after it is read.
 *
 * The messages' ids are computed after the walk, all together (blake3_many), and set before anything sees
 * the messages; until then `msgs` remembers each message (borrowed from `items`) and what its id covers. */
typedef struct {
    PyObject **msg;
    const unsigned char **in;
    size_t *len;
    size_t n, cap;
} pending_ids;

static int
pending_add(pending_ids *q, PyObject *msg, const unsigned char *in, size_t len)
{
    if (q->n == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 64;
        PyObject **m = PyMem_Realloc(q->msg, cap * sizeof(*m));
        if (m != NULL)
            q->msg = m;
        const unsigned char **i = PyMem_Realloc(q->in, cap * sizeof(*i));
        if (i != NULL)
            q->in = i;
        size_t *l = PyMem_Realloc(q->len, cap * sizeof(*l));
        if (l != NULL)
            q->len = l;
        if (m == NULL || i == NULL || l == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        q->cap = cap;
    }
    q->msg[q->n] = msg;
    q->in[q->n] = in;
    q->len[q->n++] = len;
    return 0;
}

static int
pending_finish(pending_ids *q)
{
    if (q->n == 0)
        return 0;
    unsigned char *out = PyMem_Malloc(q->n * ID_LEN);
    if (out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    blake3_many(q->in, q->len, q->n, out);
    for (size_t i = 0; i < q->n; i++) {
        if (set_slot(q->msg[i], m_descr[M_ID], bytes_at(out + i * ID_LEN, ID_LEN)) < 0) {
            PyMem_Free(out);
            return -1;
        }
    }
    PyMem_Free(out);
    return 0;
}

static PyObject *
parse_frames(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t max_frame;
    Py_buffer b;
    if (check_bound() < 0 || !PyArg_ParseTuple(args, "On", &obj, &max_frame))
        return NULL;
    if (PyObject_GetBuffer(obj, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = (const unsigned char *)b.buf;
    Py_ssize_t len = b.len, pos = 0;
    long long bad = -1;
    pending_ids ids = {NULL, NULL, NULL, 0, 0};
    PyObject *items = PyList_New(0);
    if (items == NULL)
        goto fail;
    while (len - pos >= 4) {
        uint32_t n = ((uint32_t)p[pos] << 24) | ((uint32_t)p[pos + 1] << 16) | ((uint32_t)p[pos + 2] << 8) |
                     p[pos + 3];
        if (n == 0 || (Py_ssize_t)n > max_frame) {
            bad = n;
            break;
        }
        if (len - pos - 4 < (Py_ssize_t)n)
            break;
        const unsigned char *f = p + pos + 4;
        Py_ssize_t id_len = -1;
        PyObject *item = decode_canonical(f, (Py_ssize_t)n, &id_len);
        if (item == NULL)
            goto fail;
        if (item == Py_None) {
            Py_DECREF(item);
            item = bytes_at(f, (Py_ssize_t)n);
            if (item == NULL)
                goto fail;
            id_len = -1;
        }
        int rc = PyList_Append(items, item);
        Py_DECREF(item); /* (the list holds it: the pending entry borrows it) */
        if (rc < 0 || (id_len >= 0 && pending_add(&ids, item, f + 1, (size_t)id_len) < 0))
            goto fail;
        pos += 4 + (Py_ssize_t)n;
    }
    if (pending_finish(&ids) < 0)
        goto fail;
    PyMem_Free(ids.msg);
    PyMem_Free(ids.in);
    PyMem_Free(ids.len);
    PyBuffer_Release(&b);
    return Py_BuildValue("(NnL)", items, pos, bad);
fail:
    PyMem_Free(ids.msg);
    PyMem_Free(ids.in);
    PyMem_Free(ids.len);
    Py_XDECREF(items);
    PyBuffer_Release(&b);
    return NULL;
}

/* ---------------------------------------------------------------- verification */

typedef struct {
    const unsigned char *sig, *m, *pk;
    unsigned long long mlen;
    int ok; /* sizes right */
} vitem;

static PyObject *
get_slot(PyObject *obj, PyObject *descr)
{
    return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
}

/* verify_batch(fn_address, messages, known=(), remember=None) -> bytes: one byte per message, 1 if its
 * signature verifies under its signer (src for unicast, grp for multicast), else 0. A message whose id is in
 * one of the sets in `known` counts as verified without verifying it again; the id of every message verified
 * here and found valid is added to the set `remember`. The GIL is released while verifying. */
static PyObject *
verify_batch(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    PyObject *seq, *known = NULL, *remember = Py_None;
    if (check_bound() < 0 || !PyArg_ParseTuple(args, "KO|O!O", &addr, &seq, &PyTuple_Type, &known, &remember))
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

/* join_frames(payloads) -> bytes: each payload behind its 4-byte big-endian length, in one buffer (the stream
   framing of a run of messages, written to many connections without building it for each) */
static PyObject *
join_frames(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "join_frames: a list of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(arg, i);
        if (!PyBytes_Check(b)) {
            PyErr_SetString(PyExc_TypeError, "join_frames: a list of bytes");
            return NULL;
        }
        if ((unsigned long long)PyBytes_GET_SIZE(b) > 0xFFFFFFFFull) {
            PyErr_SetString(PyExc_ValueError, "join_frames: a payload over 4 GiB");
            return NULL;
        }
        total += 4 + PyBytes_GET_SIZE(b);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(arg, i);
        Py_ssize_t len = PyBytes_GET_SIZE(b);
        p[0] = (unsigned char)(len >> 24);
        p[1] = (unsigned char)(len >> 16);
        p[2] = (unsigned char)(len >> 8);
        p[3] = (unsigned char)len;
        memcpy(p + 4, PyBytes_AS_STRING(b), (size_t)len);
        p += 4 + len;
    }
    return out;
}

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
static void
put_be64(char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (char)(v & 0xff);
}

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
        PyObject *key = PyBytes_FromStringAndSize(NULL, 8);
        PyObject *rec = PyBytes_FromStringAndSize(NULL, 8 + hn + ID_LEN + dn);
        PyObject *ek = PyBytes_FromStringAndSize(NULL, 16);
        PyObject *pair = NULL;
        if (key != NULL && rec != NULL && ek != NULL) {
            put_be64(PyBytes_AS_STRING(key), sq);
            char *r = PyBytes_AS_STRING(rec);
            put_be64(r, ms);
            memcpy(r + 8, PyBytes_AS_STRING(head), (size_t)hn);
            memcpy(r + 8 + hn, PyBytes_AS_STRING(mid), ID_LEN);
            memcpy(r + 8 + hn + ID_LEN, PyBytes_AS_STRING(data), (size_t)dn);
            put_be64(PyBytes_AS_STRING(ek), ms);
            put_be64(PyBytes_AS_STRING(ek) + 8, sq);
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

static uint64_t
be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

/* Add the (key, value) pairs of an iterable: the sequence number is the 8 bytes of the key at seq_at (big-
   endian); the id is the value's 32 bytes at id_at, or - id_at -1, a `msgs` record - at 41 after a group
   (byte 8 is 1) and at 9 without one. */
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
            PyBytes_Check(v = PyTuple_GET_ITEM(item, 1)) && PyBytes_GET_SIZE(k) >= seq_at + 8) {
            const unsigned char *kp = (const unsigned char *)PyBytes_AS_STRING(k);
            const unsigned char *vp = (const unsigned char *)PyBytes_AS_STRING(v);
            Py_ssize_t vn = PyBytes_GET_SIZE(v), at = id_at;
            if (at == -1)
                at = vn > 8 && vp[8] == 1 ? 41 : 9;
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
    .tp_name = "upsycle_router._accel.IdIndex",
    .tp_basicsize = sizeof(IdIndex),
    .tp_dealloc = (destructor)idx_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "IdIndex(salt, fp_bits=64): message id -> sequence numbers it may be stored under (fingerprints in memory)",
    .tp_methods = idx_methods,
    .tp_getset = idx_getset,
    .tp_as_sequence = &idx_as_sequence,
    .tp_new = idx_new,
};

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(Message, UnicastHeader, MulticastHeader): the types to build"},
    {"blake3_many", blake3_many_py, METH_O, "blake3_many(inputs) -> list of BLAKE3-256 digests (the batch path)"},
    {"decode", decode, METH_O, "decode(payload) -> Message | None (None: not in deterministic form)"},
    {"parse_frames", parse_frames, METH_VARARGS,
     "parse_frames(buf, max_frame) -> (items, consumed, bad_length): complete frames, decoded where possible"},
    {"verify_batch", verify_batch, METH_VARARGS,
     "verify_batch(fn, messages, known=(), remember=None) -> bytes: 1 per valid signature (GIL released)"},
    {"verify_raw", verify_raw, METH_VARARGS, "verify_raw(fn, key, data, sig) -> bool"},
    {"join_frames", join_frames, METH_O, "join_frames(payloads) -> bytes: each behind its 4-byte length"},
    {"sorted_items", sorted_items, METH_O, "sorted_items(d) -> list of (key, value), sorted by the bytes keys"},
    {"msgs_records", msgs_records, METH_VARARGS,
     "msgs_records(first_seq, head, messages, exps) -> (records, earliest): the store's records of new messages"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_accel", "The router's hot path in C (see upsycle_router/accel.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__accel(void)
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
    return m;
}
