/* pickle.dumps(x, protocol=5), byte for byte as CPython's C pickler (Modules/_pickle.c)
 * writes it, for the objects vLLM hashes: tuples of bytes, ints, str and None.
 *
 *   PROTO 5; then frames: the first write opens a frame (FRAME + 8-byte length, filled
 *   in when the frame is committed; a frame under 4 bytes loses its header); before
 *   every object is saved, a frame of >= 64 KiB is committed, so the next write opens
 *   another; a bytes or str payload of >= 64 KiB is written outside any frame.
 *   bytes: SHORT_BINBYTES (len <= 255), BINBYTES, BINBYTES8; str: SHORT_BINUNICODE,
 *   BINUNICODE, BINUNICODE8 of its UTF-8; both then MEMOIZE.
 *   int: BININT1 (0..255), BININT2 (256..65535), BININT (other int32, negatives too),
 *   else LONG1 with the shortest little-endian two's complement; never memoized.
 *   tuple: EMPTY_TUPLE (not memoized), TUPLE1/2/3 after up to 3 items, else MARK items
 *   TUPLE; then MEMOIZE. None: NONE. An object already in the memo (the same object:
 *   bytes, str and tuples are memoized by identity) is BINGET n (n < 256) or
 *   LONG_BINGET n. STOP ends the pickle inside the last frame.
 */
#ifndef KVINDEX_CHAIN_PICKLE_H
#define KVINDEX_CHAIN_PICKLE_H

#include "_chain_writer.h"

enum {
    P_MARK = '(',
    P_STOP = '.',
    P_BININT = 'J',
    P_BININT1 = 'K',
    P_BININT2 = 'M',
    P_NONE = 'N',
    P_BINGET = 'h',
    P_LONG_BINGET = 'j',
    P_TUPLE = 't',
    P_EMPTY_TUPLE = ')',
    P_PROTO = 0x80,
    P_TUPLE1 = 0x85,
    P_TUPLE2 = 0x86,
    P_TUPLE3 = 0x87,
    P_LONG1 = 0x8a,
    P_BINBYTES = 'B',
    P_SHORT_BINBYTES = 'C',
    P_BINUNICODE = 'X',
    P_SHORT_BINUNICODE = 0x8c,
    P_BINUNICODE8 = 0x8d,
    P_BINBYTES8 = 0x8e,
    P_MEMOIZE = 0x94,
    P_FRAME = 0x95,
};

/* Longest pickled int written here: LONG1, its length and 9 bytes. */
#define MAX_PICKLED_INT 11

static inline unsigned char tuple_op(Py_ssize_t n) {
    return n == 1 ? P_TUPLE1 : n == 2 ? P_TUPLE2 : n == 3 ? P_TUPLE3 : P_TUPLE;
}

static void commit_frame(Writer *w) {
    if (w->frame_start < 0) {
        return;
    }
    Py_ssize_t start = w->frame_start;
    uint64_t size = (uint64_t)(w->len - start - FRAME_HEADER);
    if (size >= FRAME_MIN) {
        w->buf[start] = P_FRAME;
        le(w->buf + start + 1, size, 8);
    } else {
        memmove(w->buf + start, w->buf + start + FRAME_HEADER, (size_t)size);
        w->len -= FRAME_HEADER;
    }
    w->frame_start = -1;
}

/* What the pickler does before saving any object: commit a frame that reached 64 KiB. */
static inline void boundary(Writer *w) {
    if (w->framing && w->frame_start >= 0 &&
        w->len - w->frame_start - FRAME_HEADER >= FRAME_TARGET) {
        commit_frame(w);
    }
}

/* A payload of >= 64 KiB goes outside any frame; the next write opens a new one. */
static int put_payload(Writer *w, const unsigned char *head, Py_ssize_t head_len,
                       const void *data, Py_ssize_t n) {
    int framing = w->framing;
    if (framing && n >= FRAME_TARGET) {
        commit_frame(w);
        w->framing = 0;
    }
    int status = put(w, head, head_len);
    if (status == OK) {
        status = put(w, data, n);
    }
    w->framing = framing;
    return status;
}

/* Write x's opcode at b; returns the end. */
static inline unsigned char *pickle_int_at(unsigned char *b, const Int *x) {
    if (x->is_big) { /* 2^63 <= v < 2^64: 8 bytes and a zero sign byte */
        b[0] = P_LONG1;
        b[1] = 9;
        le(b + 2, x->big, 8);
        b[10] = 0;
        return b + 11;
    }
    int64_t v = x->v;
    if ((uint64_t)v <= INT32_MAX) {
        /* BININT1, BININT2 or BININT, chosen without a branch: a prompt's token ids
         * mix all three at random, and a mispredicted branch per token adds up over a
         * block. Four bytes are stored whatever the length (the writer has room). */
        static const unsigned char ops[3] = {P_BININT1, P_BININT2, P_BININT};
        static const unsigned char lengths[3] = {1, 2, 4};
        unsigned kind = (unsigned)(v > 0xff) + (unsigned)(v > 0xffff);
        b[0] = ops[kind];
        le32(b + 1, (uint64_t)v);
        return b + 1 + lengths[kind];
    }
    if (v >= INT32_MIN && v <= INT32_MAX) {
        b[0] = P_BININT;
        le(b + 1, (uint64_t)v, 4);
        return b + 5;
    }
    /* LONG1: (bit length of |v|) / 8 + 1 bytes of two's complement, one fewer when the
     * top byte is only a redundant sign byte (pickle's rule: -2^63 takes 8). */
    uint64_t u = (uint64_t)v;
    uint64_t magnitude = v < 0 ? (uint64_t)(-(v + 1)) + 1 : u;
    int nbytes = (64 - __builtin_clzll(magnitude)) / 8 + 1;
    for (int i = 0; i < nbytes; i++) {
        b[2 + i] = i < 8 ? (unsigned char)(u >> (8 * i)) : (v < 0 ? 0xff : 0);
    }
    if (v < 0 && nbytes > 1 && b[2 + nbytes - 1] == 0xff && (b[2 + nbytes - 2] & 0x80)) {
        nbytes--;
    }
    b[0] = P_LONG1;
    b[1] = (unsigned char)nbytes;
    return b + 2 + nbytes;
}

static inline int pickle_int(Writer *w, const Int *x) {
    unsigned char b[MAX_PICKLED_INT];
    return put(w, b, pickle_int_at(b, x) - b);
}

/* ---- the memo, for the few objects whose identity can repeat ---- */

/* MEMOIZE; `obj` is remembered unless NULL (an object nothing else can refer to). */
static int memo_put(Writer *w, PyObject *obj) {
    if (obj != NULL) {
        if (w->memo_known == MEMO_SLOTS) {
            return UNSUPPORTED;
        }
        w->memo_obj[w->memo_known] = obj;
        w->memo_idx[w->memo_known] = w->memo_size;
        w->memo_known++;
    }
    w->memo_size++;
    return put1(w, P_MEMOIZE);
}

/* BINGET when obj was pickled before (OK); UNSUPPORTED when it was not. */
static int memo_get(Writer *w, PyObject *obj) {
    for (int i = 0; i < w->memo_known; i++) {
        if (w->memo_obj[i] == obj) {
            Py_ssize_t idx = w->memo_idx[i];
            unsigned char b[5];
            if (idx < 256) {
                b[0] = P_BINGET;
                b[1] = (unsigned char)idx;
                return put(w, b, 2) < 0 ? FAILED : OK;
            }
            b[0] = P_LONG_BINGET;
            le(b + 1, (uint64_t)idx, 4);
            return put(w, b, 5) < 0 ? FAILED : OK;
        }
    }
    return UNSUPPORTED;
}

/* SHORT_BINBYTES/BINBYTES/BINBYTES8, or the BINUNICODE forms for a str's UTF-8. */
static int pickle_sized(Writer *w, const char *data, Py_ssize_t n, PyObject *obj, int is_str) {
    unsigned char head[9];
    Py_ssize_t head_len;
    if (n <= 0xff) {
        head[0] = is_str ? P_SHORT_BINUNICODE : P_SHORT_BINBYTES;
        head[1] = (unsigned char)n;
        head_len = 2;
    } else if ((uint64_t)n <= 0xffffffffULL) {
        head[0] = is_str ? P_BINUNICODE : P_BINBYTES;
        le(head + 1, (uint64_t)n, 4);
        head_len = 5;
    } else {
        head[0] = is_str ? P_BINUNICODE8 : P_BINBYTES8;
        le(head + 1, (uint64_t)n, 8);
        head_len = 9;
    }
    int status = put_payload(w, head, head_len, data, n);
    return status != OK ? status : memo_put(w, obj);
}

/* save(obj), for None, int, bytes, str and tuples of them. */
static int pickle_obj(Writer *w, PyObject *obj, int depth) {
    boundary(w);
    if (obj == Py_None) {
        return put1(w, P_NONE);
    }
    int status;
    if (PyLong_CheckExact(obj)) {
        Int x;
        status = int_of(obj, &x);
        return status != OK ? status : pickle_int(w, &x);
    }
    if ((status = memo_get(w, obj)) != UNSUPPORTED) {
        return status;
    }
    if (PyBytes_CheckExact(obj)) {
        return pickle_sized(w, PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj), obj, 0);
    }
    if (PyUnicode_CheckExact(obj)) {
        Py_ssize_t n;
        const char *data = PyUnicode_AsUTF8AndSize(obj, &n);
        if (data == NULL) { /* lone surrogates: pickle's "surrogatepass" is left to Python */
            PyErr_Clear();
            return UNSUPPORTED;
        }
        return pickle_sized(w, data, n, obj, 1);
    }
    if (!PyTuple_CheckExact(obj) || depth >= MAX_DEPTH) {
        return UNSUPPORTED;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(obj);
    if (n == 0) {
        return put1(w, P_EMPTY_TUPLE);
    }
    if (n > 3 && (status = put1(w, P_MARK)) != OK) {
        return status;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((status = pickle_obj(w, PyTuple_GET_ITEM(obj, i), depth + 1)) != OK) {
            return status;
        }
    }
    /* A tuple cannot contain itself through tuples alone, so it is not in the memo yet
     * here (the pickler's recursive case does not arise). */
    if ((status = put1(w, tuple_op(n))) != OK) {
        return status;
    }
    return memo_put(w, obj);
}

static int pickle_ints(Writer *w, const Tokens *t, Py_ssize_t from, Py_ssize_t n) {
    if (w->frame_start >= 0 &&
        w->len - w->frame_start - FRAME_HEADER + n * MAX_PICKLED_INT < FRAME_TARGET) {
        /* No frame can fill up within these ints: one capacity check, no boundaries. */
        if (reserve(w, n * MAX_PICKLED_INT) < 0) {
            return FAILED;
        }
        unsigned char *p = w->buf + w->len;
        for (Py_ssize_t i = 0; i < n; i++) {
            Int x;
            if (token_at(t, from + i, &x) != OK) {
                return UNSUPPORTED;
            }
            p = pickle_int_at(p, &x);
        }
        w->len = p - w->buf;
        return OK;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Int x;
        int status;
        boundary(w);
        if ((status = token_at(t, from + i, &x)) != OK || (status = pickle_int(w, &x)) != OK) {
            return status;
        }
    }
    return OK;
}

/* pickle.dumps((parent, tuple(tokens[start:start+size]), extra), protocol=5), with
 * extra = (extra_keys, *the next `look` tokens) under lookahead hashing. `parent_obj`
 * is the parent's object where the caller holds it (only it could repeat). */
static int pickle_block(Writer *w, const char *parent, Py_ssize_t parent_len,
                        PyObject *parent_obj, const Tokens *t, Py_ssize_t start,
                        Py_ssize_t size, Py_ssize_t look, PyObject *extra) {
    static const unsigned char proto[2] = {P_PROTO, 5};
    int status;
    w->len = 0;
    w->frame_start = -1;
    w->framing = 0;
    w->memo_size = 0;
    w->memo_known = 0;
    if ((status = put(w, proto, 2)) != OK) {
        return status;
    }
    w->framing = 1;
    /* save((parent, block, extra)): three items, TUPLE3 */
    boundary(w);
    if ((status = pickle_sized(w, parent, parent_len, parent_obj, 0)) != OK) {
        return status;
    }
    boundary(w);
    if ((size > 3 && (status = put1(w, P_MARK)) != OK) ||
        (status = pickle_ints(w, t, start, size)) != OK ||
        (status = put1(w, tuple_op(size))) != OK || (status = memo_put(w, NULL)) != OK) {
        return status;
    }
    if (look == 0) {
        status = pickle_obj(w, extra, 0);
    } else {
        boundary(w);
        Py_ssize_t items = look + 1;
        if ((items > 3 && (status = put1(w, P_MARK)) != OK) ||
            (status = pickle_obj(w, extra, 0)) != OK ||
            (status = pickle_ints(w, t, start + size, look)) != OK ||
            (status = put1(w, tuple_op(items))) != OK) {
            return status;
        }
        status = memo_put(w, NULL);
    }
    if (status != OK || (status = put1(w, P_TUPLE3)) != OK ||
        (status = memo_put(w, NULL)) != OK || (status = put1(w, P_STOP)) != OK) {
        return status;
    }
    commit_frame(w);
    return OK;
}

/* ---- the usual block, written straight ---- */

/* The extra keys' pickle as every block's pickle holds it: after the parent and the
 * block's tuple (memo entries 0 and 1), framing never in the way (see fast_fits). A
 * block's extra keys are the same objects block after block (the LoRA adapter), so
 * this is written once per chain and copied. */
typedef struct {
    unsigned char bytes[512];
    Py_ssize_t len;
} Template;

static int template_of(Writer *scratch, PyObject *extra, Template *out) {
    if (extra == Py_None) {
        out->bytes[0] = P_NONE;
        out->len = 1;
        return OK;
    }
    scratch->len = 0;
    scratch->frame_start = -1;
    scratch->framing = 0;
    scratch->memo_size = 2;
    scratch->memo_known = 0;
    int status = pickle_obj(scratch, extra, 0);
    if (status != OK) {
        return status;
    }
    if (scratch->len > (Py_ssize_t)sizeof(out->bytes)) {
        return UNSUPPORTED;
    }
    memcpy(out->bytes, scratch->buf, (size_t)scratch->len);
    out->len = scratch->len;
    return OK;
}

/* Whether pickle_fast() can write a block: a short parent, and too few bytes for its
 * one frame to reach 64 KiB (so the pickler would split nothing). */
static inline int fast_fits(Py_ssize_t parent_len, Py_ssize_t size, Py_ssize_t look,
                            const Template *extra) {
    return parent_len <= 0xff &&
           (size + look) * MAX_PICKLED_INT + extra->len < FRAME_TARGET - 0x200;
}

static inline unsigned char *ints_at(unsigned char *p, const Tokens *t, Py_ssize_t from,
                                     Py_ssize_t n) {
    if (t->items == NULL && t->itemsize == 4 && !t->is_signed) {
        /* uint32 token ids (a binary body, or JSON ids read by api/http/_json_tokens.c):
         * read straight, no per-token dispatch on the source's kind */
        const unsigned char *src = (const unsigned char *)t->raw + 4 * from;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, src + 4 * i, 4);
            Int x = {.v = (int64_t)v, .big = 0, .is_big = 0};
            p = pickle_int_at(p, &x);
        }
        return p;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Int x;
        if (token_at(t, from + i, &x) != OK) {
            return NULL;
        }
        p = pickle_int_at(p, &x);
    }
    return p;
}

/* pickle_block()'s bytes for a block fast_fits() accepts, written straight: PROTO 5,
 * FRAME n, SHORT_BINBYTES parent MEMOIZE, [MARK] ints TUPLE(n) MEMOIZE, the extra keys
 * (with lookahead: [MARK] extra keys, ints, TUPLE(n) MEMOIZE), TUPLE3 MEMOIZE STOP.
 * UNSUPPORTED where pickle_block() would say so too (a token that is not an int in
 * [-2^63, 2^64)). */
static int pickle_fast(Writer *w, const char *parent, Py_ssize_t parent_len, const Tokens *t,
                       Py_ssize_t start, Py_ssize_t size, Py_ssize_t look,
                       const Template *extra) {
    w->len = 0;
    if (reserve(w, 32 + parent_len + (size + look) * MAX_PICKLED_INT + extra->len) < 0) {
        return FAILED;
    }
    unsigned char *p = w->buf;
    p[0] = P_PROTO;
    p[1] = 5;
    p += 2 + FRAME_HEADER;
    *p++ = P_SHORT_BINBYTES;
    *p++ = (unsigned char)parent_len;
    copy_short(p, parent, parent_len);
    p += parent_len;
    *p++ = P_MEMOIZE;
    if (size > 3) {
        *p++ = P_MARK;
    }
    if ((p = ints_at(p, t, start, size)) == NULL) {
        return UNSUPPORTED;
    }
    *p++ = tuple_op(size);
    *p++ = P_MEMOIZE;
    if (look > 2) {
        *p++ = P_MARK;
    }
    memcpy(p, extra->bytes, (size_t)extra->len);
    p += extra->len;
    if (look > 0) {
        if ((p = ints_at(p, t, start + size, look)) == NULL) {
            return UNSUPPORTED;
        }
        *p++ = tuple_op(look + 1);
        *p++ = P_MEMOIZE;
    }
    *p++ = P_TUPLE3;
    *p++ = P_MEMOIZE;
    *p++ = P_STOP;
    w->len = p - w->buf;
    w->buf[2] = P_FRAME;
    le(w->buf + 3, (uint64_t)(w->len - 2 - FRAME_HEADER), 8);
    return OK;
}

#endif
