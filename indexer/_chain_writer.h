/* The output buffer and the inputs of indexer/_chain.c: one block's hash input is
 * written into a Writer (with the pickler's framing, see _chain_pickle.h), from tokens
 * read out of a list or tuple of ints or a buffer of fixed-size integers.
 *
 * Every writer function returns OK, UNSUPPORTED (this block is left to the pure path
 * in indexer/keys.py) or FAILED (a Python exception is set, e.g. MemoryError).
 */
#ifndef KVINDEX_CHAIN_WRITER_H
#define KVINDEX_CHAIN_WRITER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define OK 0
#define UNSUPPORTED 1
#define FAILED (-1)

/* The pickler's frames (CPython Modules/_pickle.c, protocol >= 4). */
#define FRAME_TARGET (64 * 1024)
#define FRAME_MIN 4
#define FRAME_HEADER 9
/* Objects of the extra keys whose identity the memo tracks; more is left to Python. */
#define MEMO_SLOTS 32
#define MAX_DEPTH 16
#define SMALL_BUFFER 2048
/* Room kept after the hash input for SHA-256's padding (0x80, zeros, 8-byte length). */
#define PAD_ROOM 72

typedef struct {
    unsigned char *buf;
    Py_ssize_t len, cap;
    Py_ssize_t frame_start; /* offset of the open frame's header, -1 when none */
    int framing;
    Py_ssize_t memo_size; /* entries the pickler's memo would hold */
    int memo_known;       /* how many of them are objects whose identity can repeat */
    PyObject *memo_obj[MEMO_SLOTS];
    Py_ssize_t memo_idx[MEMO_SLOTS];
    unsigned char small[SMALL_BUFFER];
} Writer;

static Writer *writer_new(void) {
    Writer *w = PyMem_Malloc(sizeof(Writer));
    if (w == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    w->buf = w->small;
    w->cap = SMALL_BUFFER;
    w->len = 0;
    w->frame_start = -1;
    w->framing = 0;
    return w;
}

static void writer_free(Writer *w) {
    if (w->buf != w->small) {
        PyMem_Free(w->buf);
    }
    PyMem_Free(w);
}

/* Make room for `need` more bytes (and the padding after them). */
static int reserve(Writer *w, Py_ssize_t need) {
    if (w->len + need + PAD_ROOM <= w->cap) {
        return OK;
    }
    Py_ssize_t cap = w->cap * 2;
    if (cap < w->len + need + PAD_ROOM) {
        cap = w->len + need + PAD_ROOM;
    }
    unsigned char *buf;
    if (w->buf == w->small) {
        buf = PyMem_Malloc((size_t)cap);
        if (buf != NULL) {
            memcpy(buf, w->small, (size_t)w->len);
        }
    } else {
        buf = PyMem_Realloc(w->buf, (size_t)cap);
    }
    if (buf == NULL) {
        PyErr_NoMemory();
        return FAILED;
    }
    w->buf = buf;
    w->cap = cap;
    return OK;
}

/* Append n bytes; with framing on and no frame open, open one first (its header is
 * filled in when the frame is committed). */
static inline int put(Writer *w, const void *data, Py_ssize_t n) {
    int opens = w->framing && w->frame_start < 0;
    if (reserve(w, n + FRAME_HEADER) < 0) {
        return FAILED;
    }
    if (opens) {
        w->frame_start = w->len;
        w->len += FRAME_HEADER;
    }
    memcpy(w->buf + w->len, data, (size_t)n);
    w->len += n;
    return OK;
}

static inline int put1(Writer *w, unsigned char op) { return put(w, &op, 1); }

/* memcpy of a digest: fixed sizes compile to a few vector moves, where a variable
 * length became `rep movsq`, whose start-up cost was a quarter of writing a block. */
static inline void copy_short(unsigned char *dst, const char *src, Py_ssize_t n) {
    if (n == 32) {
        memcpy(dst, src, 32);
    } else if (n == 16) {
        memcpy(dst, src, 16);
    } else {
        memcpy(dst, src, (size_t)n);
    }
}

/* The low 4 bytes of v, little-endian: one store on a little-endian machine. */
static inline void le32(unsigned char *out, uint64_t v) {
#if PY_LITTLE_ENDIAN
    uint32_t u = (uint32_t)v;
    memcpy(out, &u, 4);
#else
    for (int i = 0; i < 4; i++) {
        out[i] = (unsigned char)(v >> (8 * i));
    }
#endif
}

static inline void le(unsigned char *out, uint64_t v, int n) {
    for (int i = 0; i < n; i++) {
        out[i] = (unsigned char)(v >> (8 * i));
    }
}

/* ---- ints: a token or an int extra key ---- */

/* A value in [-2^63, 2^63), or `big` for [2^63, 2^64). */
typedef struct {
    int64_t v;
    uint64_t big;
    int is_big;
} Int;

/* The value of an exact int that fits one machine word, read inline (a token then
 * costs a few instructions instead of a PyLong_AsLongLongAndOverflow call); 0 for
 * any other int. */
static inline int compact_value(PyObject *o, int64_t *v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *v = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 1;
    }
#else
    Py_ssize_t digits = Py_SIZE(o); /* signed count of 30-bit digits */
    if (digits >= -1 && digits <= 1) {
        *v = (int64_t)digits * (int64_t)((PyLongObject *)o)->ob_digit[0];
        return 1;
    }
#endif
    return 0;
}

static int int_of(PyObject *o, Int *out) {
    if (!PyLong_CheckExact(o)) {
        return UNSUPPORTED;
    }
    out->is_big = 0;
    if (compact_value(o, &out->v)) {
        return OK;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) {
        out->v = v;
        return OK;
    }
    if (overflow < 0) {
        return UNSUPPORTED;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return UNSUPPORTED;
    }
    out->big = u;
    out->is_big = 1;
    return OK;
}

/* ---- token sources: a list or tuple of ints, or a buffer of fixed-size ints ---- */

typedef struct {
    PyObject **items; /* list or tuple items, or NULL for a buffer */
    const char *raw;
    int itemsize;
    int is_signed;
    Py_ssize_t n;
    Py_buffer view;
    int held;
} Tokens;

static inline int token_at(const Tokens *t, Py_ssize_t i, Int *x) {
    x->is_big = 0;
    if (t->items != NULL) {
        PyObject *o = t->items[i];
        if (PyLong_CheckExact(o) && compact_value(o, &x->v)) {
            return OK;
        }
        return int_of(o, x);
    }
    const char *p = t->raw + i * t->itemsize;
    switch (t->itemsize * 2 + t->is_signed) {
    case 2: x->v = *(const uint8_t *)p; break;
    case 3: x->v = *(const int8_t *)p; break;
    case 4: x->v = *(const uint16_t *)p; break;
    case 5: x->v = *(const int16_t *)p; break;
    case 8: x->v = *(const uint32_t *)p; break;
    case 9: x->v = *(const int32_t *)p; break;
    case 17: x->v = *(const int64_t *)p; break;
    default: { /* 16: uint64 */
        uint64_t u = *(const uint64_t *)p;
        if (u > (uint64_t)INT64_MAX) {
            x->big = u;
            x->is_big = 1;
        } else {
            x->v = (int64_t)u;
        }
    }
    }
    return OK;
}

static int tokens_open(PyObject *obj, Tokens *t) {
    memset(t, 0, sizeof(*t));
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        t->items = PySequence_Fast_ITEMS(obj);
        t->n = PySequence_Fast_GET_SIZE(obj);
        return OK;
    }
    if (PyObject_GetBuffer(obj, &t->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError,
                        "tokens must be a list or tuple of ints or a buffer of integers");
        return FAILED;
    }
    t->held = 1;
    const char *f = t->view.format != NULL ? t->view.format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN)) {
        f++;
    }
    int size = (int)t->view.itemsize, ok = f[0] != '\0' && f[1] == '\0' && t->view.ndim <= 1;
    if (ok) {
        switch (f[0]) {
        case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': t->is_signed = 1; break;
        case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': t->is_signed = 0; break;
        default: ok = 0;
        }
    }
    if (!ok || !(size == 1 || size == 2 || size == 4 || size == 8)) {
        PyErr_Format(PyExc_TypeError, "tokens: a buffer of integers is needed, got format %s",
                     t->view.format != NULL ? t->view.format : "B");
        PyBuffer_Release(&t->view);
        t->held = 0;
        return FAILED;
    }
    t->raw = t->view.buf;
    t->itemsize = size;
    t->n = t->view.len / size;
    return OK;
}

static void tokens_close(Tokens *t) {
    if (t->held) {
        PyBuffer_Release(&t->view);
        t->held = 0;
    }
}

#endif
