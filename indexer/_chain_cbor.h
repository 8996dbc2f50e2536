/* cbor2.dumps(x, canonical=True), byte for byte, for the objects vLLM hashes: tuples
 * (arrays) of bytes, ints, str and None. Every item is a head (major type in the top
 * 3 bits, then the argument: below 24 in the same byte, else in the shortest of 1, 2,
 * 4 or 8 big-endian bytes) and, for bytes and str, the payload. Ints are major type 0
 * (v >= 0) or 1 (argument -1 - v); cbor2 writes ints beyond 64 bits as bignum tags,
 * which are left to Python, as is everything else. No value sharing or string
 * references (cbor2's defaults), so identity does not matter here.
 */
#ifndef KVINDEX_CHAIN_CBOR_H
#define KVINDEX_CHAIN_CBOR_H

#include "_chain_writer.h"

#define C_UINT 0
#define C_NEGINT 1
#define C_BYTES 2
#define C_TEXT 3
#define C_ARRAY 4
#define C_NULL 0xf6

static inline unsigned char *cbor_head_at(unsigned char *b, unsigned major, uint64_t arg) {
    unsigned char m = (unsigned char)(major << 5);
    if (arg < 24) {
        *b = m | (unsigned char)arg;
        return b + 1;
    }
    int n = arg <= 0xff ? 1 : arg <= 0xffff ? 2 : arg <= 0xffffffffULL ? 4 : 8;
    *b++ = m | (unsigned char)(n == 1 ? 24 : n == 2 ? 25 : n == 4 ? 26 : 27);
    for (int i = n - 1; i >= 0; i--) {
        *b++ = (unsigned char)(arg >> (8 * i));
    }
    return b;
}

static inline int cbor_head(Writer *w, unsigned major, uint64_t arg) {
    if (reserve(w, 9) < 0) {
        return FAILED;
    }
    w->len = cbor_head_at(w->buf + w->len, major, arg) - w->buf;
    return OK;
}

static inline unsigned char *cbor_int_at(unsigned char *b, const Int *x) {
    if (!x->is_big && (uint64_t)x->v <= 0xffffffffULL) {
        /* A token id: its head chosen without a branch (a prompt mixes the 1-, 2-, 3-
         * and 5-byte forms at random), four argument bytes stored whatever the length
         * (the writer has room). */
        static const unsigned char heads[4] = {0, 24, 25, 26};
        static const unsigned char lengths[4] = {0, 1, 2, 4};
        uint64_t v = (uint64_t)x->v;
        unsigned kind = (unsigned)(v > 23) + (unsigned)(v > 0xff) + (unsigned)(v > 0xffff);
        b[0] = kind ? heads[kind] : (unsigned char)v;
        uint32_t top = (uint32_t)(v << (8 * (4 - lengths[kind]))); /* argument, left-aligned */
        b[1] = (unsigned char)(top >> 24);
        b[2] = (unsigned char)(top >> 16);
        b[3] = (unsigned char)(top >> 8);
        b[4] = (unsigned char)top;
        return b + 1 + lengths[kind];
    }
    if (x->is_big) {
        return cbor_head_at(b, C_UINT, x->big);
    }
    if (x->v >= 0) {
        return cbor_head_at(b, C_UINT, (uint64_t)x->v);
    }
    return cbor_head_at(b, C_NEGINT, (uint64_t)(-(x->v + 1)));
}

static int cbor_ints(Writer *w, const Tokens *t, Py_ssize_t from, Py_ssize_t n) {
    if (reserve(w, n * 9) < 0) {
        return FAILED;
    }
    unsigned char *p = w->buf + w->len;
    for (Py_ssize_t i = 0; i < n; i++) {
        Int x;
        if (token_at(t, from + i, &x) != OK) {
            return UNSUPPORTED;
        }
        p = cbor_int_at(p, &x);
    }
    w->len = p - w->buf;
    return OK;
}

static int cbor_sized(Writer *w, unsigned major, const char *data, Py_ssize_t n) {
    int status = cbor_head(w, major, (uint64_t)n);
    return status != OK ? status : put(w, data, n);
}

static int cbor_obj(Writer *w, PyObject *obj, int depth) {
    if (obj == Py_None) {
        return put1(w, C_NULL);
    }
    int status;
    if (PyLong_CheckExact(obj)) {
        Int x;
        if ((status = int_of(obj, &x)) != OK || (status = reserve(w, 9)) != OK) {
            return status;
        }
        w->len = cbor_int_at(w->buf + w->len, &x) - w->buf;
        return OK;
    }
    if (PyBytes_CheckExact(obj)) {
        return cbor_sized(w, C_BYTES, PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj));
    }
    if (PyUnicode_CheckExact(obj)) {
        Py_ssize_t n;
        const char *data = PyUnicode_AsUTF8AndSize(obj, &n);
        if (data == NULL) { /* cbor2 raises on lone surrogates: let it, in Python */
            PyErr_Clear();
            return UNSUPPORTED;
        }
        return cbor_sized(w, C_TEXT, data, n);
    }
    if (!PyTuple_CheckExact(obj) || depth >= MAX_DEPTH) {
        return UNSUPPORTED;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(obj);
    if ((status = cbor_head(w, C_ARRAY, (uint64_t)n)) != OK) {
        return status;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((status = cbor_obj(w, PyTuple_GET_ITEM(obj, i), depth + 1)) != OK) {
            return status;
        }
    }
    return OK;
}

/* cbor2.dumps((parent, tuple(tokens[start:start+size]), extra), canonical=True), with
 * extra = (extra_keys, *the next `look` tokens) under lookahead hashing. */
static int cbor_block(Writer *w, const char *parent, Py_ssize_t parent_len, const Tokens *t,
                      Py_ssize_t start, Py_ssize_t size, Py_ssize_t look, PyObject *extra) {
    int status;
    w->len = 0;
    w->framing = 0;
    w->frame_start = -1;
    if ((status = cbor_head(w, C_ARRAY, 3)) != OK ||
        (status = cbor_sized(w, C_BYTES, parent, parent_len)) != OK ||
        (status = cbor_head(w, C_ARRAY, (uint64_t)size)) != OK ||
        (status = cbor_ints(w, t, start, size)) != OK) {
        return status;
    }
    if (look == 0) {
        return cbor_obj(w, extra, 0);
    }
    if ((status = cbor_head(w, C_ARRAY, (uint64_t)(look + 1))) != OK ||
        (status = cbor_obj(w, extra, 0)) != OK) {
        return status;
    }
    return cbor_ints(w, t, start + size, look);
}

#endif
