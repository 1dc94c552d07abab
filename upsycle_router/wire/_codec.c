/* upsycle_router.wire._codec: the wire codec's hot path in C (optional; upsycle_router/wire/accel.py has the
 * Python equivalents and picks one; typed by _codec.pyi beside this file).
 *
 * Theory of operation
 * -------------------
 * Cutting frames out of a stream and decoding the routed message in each is what costs the event loop most
 * per message when written in Python. parse_frames() walks the 4-byte big-endian length prefixes of a receive
 * buffer (docs/protocol.md, framing) and decodes every frame that holds a routed message in its one
 * deterministic encoding straight into the package's own frozen values (Message, UnicastHeader,
 * MulticastHeader: see _message.h), without running their Python __init__. The message id is BLAKE3 over the
 * frame slice `enc(TYPE) || enc(HEADER) || enc(BODY) || enc(SIG)`: no copy, no re-encoding. The ids of all the
 * messages one call decodes are computed together at the end, with the official C implementation of BLAKE3
 * (vendor/blake3, linked into this module only): the first 1 KiB chunks of messages longer than one chunk go
 * through blake3_hash_many side by side (up to 16 in the SIMD lanes of one core), and only each message's rest
 * is hashed on its own. For a 1.2 KiB message that is a third of the cost of hashing it alone, and it spares
 * the call into the blake3 package. Any other frame (a session frame, a message not in deterministic form,
 * garbage) is returned as its payload bytes for the strict Python decoder, which names the offending field.
 * The accepted form is exactly the one upsycle_router/wire/messages.py's _decode_canonical accepts;
 * tests/wire/test_accel.py checks that both ways.
 *
 * join_frames() is the other direction: a run of payloads, each behind its length, in one buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_message.h"
#include "blake3.h"
#include "blake3_impl.h" /* blake3_hash_many, IV, CHUNK_START, CHUNK_END */

#define MODULE "upsycle_router.wire._codec"

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
        PyObject *h = get_slot(msg, m_descr[M_HEADER]);
        if (h != NULL) {
            if (multicast) {
                PyObject *t = get_slot(h, g_descr[G_SN]);
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

/* decode(payload) -> Message | None */
static PyObject *
decode(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    if (check_bound(MODULE) < 0 || PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
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
    if (check_bound(MODULE) < 0 || !PyArg_ParseTuple(args, "On", &obj, &max_frame))
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


/* ---------------------------------------------------------------- stored messages against their ids */

/* The bytes a message id covers inside a message's deterministic encoding: after the array head (4 items, or
 * 5 with VIA, a 32-byte string at the end: its 34 bytes are left out). 0 if `p` is no such encoding. */
static int
id_span(const unsigned char *p, Py_ssize_t n, const unsigned char **in, size_t *len)
{
    if (n >= 1 && p[0] == 0x84) {
        *in = p + 1;
        *len = (size_t)(n - 1);
        return 1;
    }
    if (n >= 35 && p[0] == 0x85 && p[n - 34] == 0x58 && p[n - 33] == 0x20) {
        *in = p + 1;
        *len = (size_t)(n - 35);
        return 1;
    }
    *in = p;
    *len = 0;
    return 0;
}

/* damaged(datas, ids) -> [i, ...]: the positions whose bytes are not a message with that id (see accel.py) */
static PyObject *
damaged(PyObject *self, PyObject *args)
{
    PyObject *datas, *ids;
    if (!PyArg_ParseTuple(args, "OO:damaged", &datas, &ids))
        return NULL;
    if (!PyList_Check(datas) || !PyList_Check(ids) || PyList_GET_SIZE(datas) != PyList_GET_SIZE(ids)) {
        PyErr_SetString(PyExc_TypeError, "damaged() takes two lists of bytes of the same length");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(datas);
    size_t m = n ? (size_t)n : 1;
    const unsigned char **ins = PyMem_Malloc(m * sizeof(*ins));
    size_t *lens = PyMem_Malloc(m * sizeof(*lens));
    unsigned char *out = PyMem_Malloc(m * ID_LEN);
    char *framed = PyMem_Malloc(m);
    PyObject *res = NULL;
    if (ins == NULL || lens == NULL || out == NULL || framed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(datas, i), *id = PyList_GET_ITEM(ids, i);
        if (!PyBytes_Check(d) || !PyBytes_Check(id)) {
            PyErr_SetString(PyExc_TypeError, "damaged() takes two lists of bytes of the same length");
            goto done;
        }
        framed[i] = (char)id_span((const unsigned char *)PyBytes_AS_STRING(d), PyBytes_GET_SIZE(d), &ins[i],
                                  &lens[i]);
    }
    blake3_many(ins, lens, (size_t)n, out);
    res = PyList_New(0);
    if (res == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        if (framed[i] && PyBytes_GET_SIZE(id) == ID_LEN && memcmp(out + i * ID_LEN, PyBytes_AS_STRING(id), ID_LEN) == 0)
            continue;
        PyObject *k = PyLong_FromSsize_t(i);
        if (k == NULL || PyList_Append(res, k) < 0) {
            Py_XDECREF(k);
            Py_CLEAR(res);
            goto done;
        }
        Py_DECREF(k);
    }
done:
    PyMem_Free(ins);
    PyMem_Free(lens);
    PyMem_Free(out);
    PyMem_Free(framed);
    return res;
}

static PyMethodDef methods[] = {
    BIND_METHOD,
    {"blake3_many", blake3_many_py, METH_O, "blake3_many(inputs) -> list of BLAKE3-256 digests (the batch path)"},
    {"damaged", damaged, METH_VARARGS,
     "damaged(datas, ids) -> [i, ...]: positions whose bytes are not a message with that id (VIA aside)"},
    {"decode", decode, METH_O, "decode(payload) -> Message | None (None: not in deterministic form)"},
    {"parse_frames", parse_frames, METH_VARARGS,
     "parse_frames(buf, max_frame) -> (items, consumed, bad_length): complete frames, decoded where possible"},
    {"join_frames", join_frames, METH_O, "join_frames(payloads) -> bytes: each behind its 4-byte length"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_codec", "The wire codec's hot path in C (see upsycle_router/wire/accel.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__codec(void)
{
    return PyModule_Create(&module);
}
