/* The Redis lookup's client side, compiled: indexer/redis/read.py's and
 * indexer/redis/walk.py's fast path.
 *
 * Why C: with Redis layout 2 a lookup is plain HMGETs and the walk runs in the replica,
 * and in Python the client side (packing the fields with numpy, hiredis making one bytes
 * object per block and putting them back in key order, the run-length walk and its
 * answer) cost more CPU than Redis spends on the same lookup, and the replica's CPU is
 * what caps /score (bench/bench_redis.py). Here:
 *
 * - exchange sends them and reads the answer on a plain socket, the GIL released only
 *   while it waits for Redis (_redis_io.h);
 * - pack_reads writes the HMGETs (one per bucket, fields in RESP) in one pass over the
 *   keys, which may be the request's list of ints: no numpy array on the way;
 * - frame says when MULTI/EXEC's whole answer is in the read buffer, and parse_lookup
 *   copies each bitmap from those bytes into its key's row of one matrix (key order,
 *   zero-padded to the widest bitmap): no Python object per block;
 * - prefix_walk walks that matrix: per run of identical rows, one AND of the members
 *   still alive, counts added per run; then the answer rows (MemberMatch) sorted
 *   longest first, most on GPU, then by member name; held_positions gives the same
 *   matrix per member and tier as position masks (hybrid models, _redis_presence.h).
 *
 * The pure path (redis_wire.py's reply readers, redis_read.rows_of, redis_walk.py's numpy
 * walk) gives identical answers; tests/test_redis_compiled.py checks the two against
 * each other and both against the memory backend. Whatever parse_lookup does not
 * expect (an error reply, a count that does not add up) it leaves to the pure
 * reader by returning None.
 */
#include "_redis_resp.h"

#include <limits.h>

/* Bucket counts up to this are sorted by counting; above, keys are sorted by
 * (bucket, position) with qsort (65,536 counters cost more than sorting 512 keys). */
#define COUNTING_SORT_MAX 4096

/* An int's value in [0, 2**64); -1 with an exception set otherwise. Where unsigned long
 * has 64 bits, PyLong_AsUnsignedLong: it reads the digits directly, where
 * PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray (3.11). */
static unsigned long long as_u64(PyObject *v) {
#if ULONG_MAX == UINT64_MAX
    return PyLong_AsUnsignedLong(v);
#else
    return PyLong_AsUnsignedLongLong(v);
#endif
}

static int read_keys(PyObject *keys, uint64_t **out, Py_ssize_t *n) {
    if (PyList_Check(keys) || PyTuple_Check(keys)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(keys);
        uint64_t *k = PyMem_Malloc(sizeof(uint64_t) * (size_t)(len ? len : 1));
        if (k == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < len; i++) {
            /* an __index__ may change the list: read it again each time */
            if (i >= PySequence_Fast_GET_SIZE(keys)) {
                len = i;
                break;
            }
            PyObject *item = PySequence_Fast_ITEMS(keys)[i];
            unsigned long long v;
            Py_INCREF(item);
            if (PyLong_Check(item)) {
                v = as_u64(item);
            } else {
                PyObject *index = PyNumber_Index(item);
                v = index ? as_u64(index) : (unsigned long long)-1;
                Py_XDECREF(index);
            }
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                PyMem_Free(k);
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError,
                             "block keys must be integers in [0, 2**64), got %R at %zd",
                             item, i);
                Py_DECREF(item);
                return -1;
            }
            Py_DECREF(item);
            k[i] = (uint64_t)v;
        }
        *out = k;
        *n = len;
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(keys, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *f = view.format ? view.format : "B";
    if (*f == '=' || *f == '<' || *f == '@') {
        f++;
    }
    if (view.itemsize != 8 || (strcmp(f, "Q") != 0 && strcmp(f, "L") != 0)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "block keys must be a list of ints or uint64 words");
        return -1;
    }
    Py_ssize_t len = view.len / 8;
    uint64_t *k = PyMem_Malloc(sizeof(uint64_t) * (size_t)(len ? len : 1));
    if (k == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(k, view.buf, (size_t)len * 8);
    PyBuffer_Release(&view);
    *out = k;
    *n = len;
    return 0;
}

static int by_bucket_then_position(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Positions 0..n-1 ordered by bucket (``bucket[i]``: key i's), stable: the order the
 * fields are read in. */
static int bucket_order(const uint32_t *bucket, Py_ssize_t n, long buckets, int32_t *order) {
    if (buckets <= COUNTING_SORT_MAX) {
        Py_ssize_t *start = PyMem_Calloc((size_t)buckets + 1, sizeof(Py_ssize_t));
        if (start == NULL) {
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            start[bucket[i] + 1]++;
        }
        for (long b = 0; b < buckets; b++) {
            start[b + 1] += start[b];
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            order[start[bucket[i]]++] = (int32_t)i;
        }
        PyMem_Free(start);
        return 0;
    }
    uint64_t *packed = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (packed == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        packed[i] = ((uint64_t)bucket[i] << 32) | (uint64_t)i;
    }
    qsort(packed, (size_t)n, sizeof(uint64_t), by_bucket_then_position);
    for (Py_ssize_t i = 0; i < n; i++) {
        order[i] = (int32_t)(packed[i] & 0xFFFFFFFFu);
    }
    PyMem_Free(packed);
    return 0;
}

static char *put_be64(char *p, uint64_t v) {
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    v = __builtin_bswap64(v);
    memcpy(p, &v, 8);
    return p + 8;
#else
    for (int i = 7; i >= 0; i--) {
        *p++ = (char)(v >> (8 * i));
    }
    return p;
#endif
}

/* v in decimal at p (sprintf's cost per HMGET was a fifth of the packing). */
static char *put_decimal(char *p, uint64_t v) {
    char digits[20];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n) {
        *p++ = digits[--n];
    }
    return p;
}

PyDoc_STRVAR(pack_reads_doc,
"pack_reads(keys, buckets, bucket_prefix, tiers) -> (body, commands, order)\n\n"
"One HMGET per bucket the keys fall in (bucket: the key's low 16 bits modulo\n"
"``buckets``; key name: ``bucket_prefix`` + the number), its fields each key as 8\n"
"big-endian bytes (with ``tiers`` also key + 1 and key + 2 for CPU and STORAGE), as RESP.\n"
"``order`` (native int32) is the key position of each field group in reply order.\n"
"``keys``: a list of ints or a buffer of uint64; ValueError unless each is in [0, 2**64).");

static PyObject *pack_reads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "pack_reads(keys, buckets, bucket_prefix: bytes, tiers)");
        return NULL;
    }
    long buckets = PyLong_AsLong(args[1]);
    if (buckets == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (buckets < 1 || buckets > 65536) {
        PyErr_SetString(PyExc_ValueError, "buckets must be in 1..65536");
        return NULL;
    }
    int tiers = PyObject_IsTrue(args[3]);
    if (tiers < 0) {
        return NULL;
    }
    const char *prefix = PyBytes_AS_STRING(args[2]);
    Py_ssize_t prefix_len = PyBytes_GET_SIZE(args[2]);
    uint64_t *keys;
    Py_ssize_t n;
    if (read_keys(args[0], &keys, &n) < 0) {
        return NULL;
    }
    if (n > INT32_MAX / 3) {
        PyMem_Free(keys);
        PyErr_SetString(PyExc_ValueError, "too many block keys in one lookup");
        return NULL;
    }
    /* a 32-bit modulo, once per key: the 64-bit division is much slower */
    uint32_t *bucket = PyMem_Malloc(sizeof(uint32_t) * (size_t)(n ? n : 1));
    if (bucket == NULL) {
        PyMem_Free(keys);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        bucket[i] = (uint32_t)(keys[i] & 0xFFFF) % (uint32_t)buckets;
    }
    PyObject *order_bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int32_t) * n);
    int32_t *order = order_bytes ? (int32_t *)PyBytes_AS_STRING(order_bytes) : NULL;
    if (order == NULL || bucket_order(bucket, n, buckets, order) < 0) {
        PyMem_Free(keys);
        PyMem_Free(bucket);
        Py_XDECREF(order_bytes);
        return order ? PyErr_NoMemory() : NULL;
    }
    Py_ssize_t per_key = tiers ? 44 : 14, head_max = 64 + prefix_len;
    Py_ssize_t cap = n * per_key + (n ? n : 1) * head_max;
    PyObject *body = PyBytes_FromStringAndSize(NULL, cap);
    if (body == NULL) {
        PyMem_Free(keys);
        PyMem_Free(bucket);
        Py_DECREF(order_bytes);
        return NULL;
    }
    char *p = PyBytes_AS_STRING(body);
    long commands = 0;
    for (Py_ssize_t at = 0; at < n;) {
        uint32_t number_of = bucket[order[at]];
        Py_ssize_t stop = at + 1;
        while (stop < n && bucket[order[stop]] == number_of) {
            stop++;
        }
        char number[24];
        int digits = (int)(put_decimal(number, (uint64_t)number_of) - number);
        *p++ = '*';
        p = put_decimal(p, (uint64_t)((stop - at) * (tiers ? 3 : 1) + 2));
        static const char hmget[] = "\r\n$5\r\nHMGET\r\n$";
        memcpy(p, hmget, sizeof hmget - 1);
        p = put_decimal(p + sizeof hmget - 1, (uint64_t)(prefix_len + digits));
        *p++ = '\r';
        *p++ = '\n';
        memcpy(p, prefix, (size_t)prefix_len);
        p += prefix_len;
        memcpy(p, number, (size_t)digits);
        p += digits;
        *p++ = '\r';
        *p++ = '\n';
        for (; at < stop; at++) {
            uint64_t key = keys[order[at]];
            memcpy(p, "$8\r\n", 4);
            p = put_be64(p + 4, key);
            *p++ = '\r';
            *p++ = '\n';
            for (int tier = 1; tiers && tier <= 2; tier++) {
                memcpy(p, "$9\r\n", 4);
                p = put_be64(p + 4, key);
                *p++ = (char)tier;
                *p++ = '\r';
                *p++ = '\n';
            }
        }
        commands++;
    }
    PyMem_Free(keys);
    PyMem_Free(bucket);
    if (_PyBytes_Resize(&body, p - PyBytes_AS_STRING(body)) < 0) {
        Py_DECREF(order_bytes);
        return NULL;
    }
    return Py_BuildValue("(NlN)", body, commands, order_bytes);
}

/* -- reading the answer ---------------------------------------------------------------- */

static int read_buffer(PyObject *obj, Py_ssize_t end, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (end < 0 || end > view->len) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "end is outside the buffer");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(frame_doc,
"frame(buffer, end, count) -> int\n\n"
"Where ``count`` whole replies starting at buffer[0] end, or -1 when buffer[:end]\n"
"does not hold them all yet; ValueError for bytes that are not RESP.");

static PyObject *frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t end, count;
    Py_buffer view;
    if (nargs != 3 || (end = PyLong_AsSsize_t(args[1])) == -1 ||
        (count = PyLong_AsSsize_t(args[2])) == -1) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "frame(buffer, end, count)");
        }
        return NULL;
    }
    if (read_buffer(args[0], end, &view) < 0) {
        return NULL;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < count && at >= 0; i++) {
        at = resp_skip(view.buf, at, end, 0);
    }
    PyBuffer_Release(&view);
    if (at == RESP_BAD) {
        PyErr_SetString(PyExc_ValueError, "the reply is not RESP");
        return NULL;
    }
    return PyLong_FromSsize_t(at);
}

PyDoc_STRVAR(decode_doc,
"decode(buffer, end, count, error_factory) -> list\n\n"
"``count`` whole replies from buffer[0] as Python objects, as hiredis's reader gives\n"
"them (an error reply as error_factory(message)).");

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t end, count;
    Py_buffer view;
    if (nargs != 4 || (end = PyLong_AsSsize_t(args[1])) == -1 ||
        (count = PyLong_AsSsize_t(args[2])) == -1) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "decode(buffer, end, count, error_factory)");
        }
        return NULL;
    }
    if (read_buffer(args[0], end, &view) < 0) {
        return NULL;
    }
    PyObject *out = PyList_New(count);
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *item = resp_value(view.buf, &at, end, args[3], 0);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    PyBuffer_Release(&view);
    return out;
}

#include "_redis_rows.h"
#include "_redis_io.h"
#include "_redis_presence.h"

static PyMethodDef methods[] = {
    {"pack_reads", (PyCFunction)(void (*)(void))pack_reads, METH_FASTCALL, pack_reads_doc},
    {"frame", (PyCFunction)(void (*)(void))frame, METH_FASTCALL, frame_doc},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, decode_doc},
    {"parse_lookup", (PyCFunction)(void (*)(void))parse_lookup, METH_FASTCALL, parse_lookup_doc},
    {"prefix_walk", (PyCFunction)(void (*)(void))prefix_walk, METH_FASTCALL, prefix_walk_doc},
    {"exchange", (PyCFunction)(void (*)(void))exchange, METH_FASTCALL, exchange_doc},
    {"held_positions", (PyCFunction)(void (*)(void))held_positions, METH_FASTCALL,
     held_positions_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_redis_lookup",
    "The Redis lookup's client side, compiled: HMGET packing, reply reading, the walk.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__redis_lookup(void) { return PyModule_Create(&module); }
