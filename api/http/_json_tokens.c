/* A JSON /score or /route body's token_ids or block_hashes array read straight into
 * native integers (api/http/json_tokens.py wraps it).
 *
 * Why C: msgspec decodes a long body's array into one Python int per item, and the
 * compiled hash chain (or the range check and the lookup) then reads them back one by
 * one: most of a request's CPU (bench/README.md). Here the array's digits become
 * native uint32s (token ids) or uint64s
 * (block hashes) in one pass, and msgspec decodes what is left of the body, with the
 * array replaced by null (a few dozen bytes); the caller sets the field afterwards.
 *
 * split(body, field, wide=True) -> None | (rest, items)
 *   field:  "token_ids" (uint32 items) or "block_hashes" (uint64 items);
 *   rest:   the body with the top-level array of that name replaced by null;
 *   items:  bytes, the array's integers (block hashes given in hex: their low 64
 *           bits) as native uint32 or uint64, in order;
 *   wide:   read the array 64 bytes at a time with SSE2 (x86-64; elsewhere, and with
 *           wide=False, byte by byte: the same answers, tests compare them).
 *
 * The rule that keeps it exact: it answers only for a body whose array msgspec would
 * decode into the same integers, and leaves everything else to msgspec. It returns None
 * (decode the whole body with msgspec) unless the body is one JSON object whose
 * top-level keys are plain (no backslash escape), with the field given exactly once and
 * its value an array of plain non-negative integers (digits only, no leading zero, no
 * fraction or exponent, at most 2**32 - 1 or 2**64 - 1); block hashes may also be hex
 * strings that the schema's pattern takes, without escapes, which become their low 64
 * bits as api/http/score_inputs.py's block_keys makes them (hex was the slow form:
 * msgspec's pattern check and a Python loop per hash). Being stricter than
 * msgspec only costs speed. Anything wrong elsewhere in the body (a bad field, malformed
 * JSON after the array) is still in the rest, so msgspec rejects the rest and the caller
 * decodes the whole body to give msgspec's own error for it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_WIDE 1
#else
#define HAVE_WIDE 0
#endif

static inline int is_ws(unsigned char c) {
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

static inline const unsigned char *skip_ws(const unsigned char *p, const unsigned char *end) {
    while (p < end && is_ws(*p)) p++;
    return p;
}

/* Past a string whose opening quote is at p; NULL if it never closes. */
static const unsigned char *skip_string(const unsigned char *p, const unsigned char *end,
                                        int *escaped) {
    for (p++; p < end; p++) {
        if (*p == '"') return p + 1;
        if (*p == '\\') {
            *escaped = 1;
            p++;
        }
    }
    return NULL;
}

/* Past one value of any kind at p (not validated: msgspec reads it in the rest);
 * NULL where the body ends first. */
static const unsigned char *skip_value(const unsigned char *p, const unsigned char *end) {
    int escaped = 0;
    if (p >= end) return NULL;
    if (*p == '"') return skip_string(p, end, &escaped);
    if (*p == '{' || *p == '[') {
        Py_ssize_t depth = 0;
        while (p < end) {
            unsigned char c = *p;
            if (c == '"') {
                p = skip_string(p, end, &escaped);
                if (p == NULL) return NULL;
                continue;
            }
            if (c == '{' || c == '[') depth++;
            else if (c == '}' || c == ']') {
                if (--depth == 0) return p + 1;
            }
            p++;
        }
        return NULL;
    }
    /* a scalar: up to the next delimiter */
    while (p < end && *p != ',' && *p != '}' && *p != ']' && !is_ws(*p)) p++;
    return p;
}

/* The digits at p as a number: how many there are in these 8 bytes (0..8; 8 means
 * more may follow) and their value (when there is one). Needs 8 readable bytes at p. */
static inline int word_digits(const unsigned char *p, uint64_t *value) {
    uint64_t x;
    memcpy(&x, p, 8);
#if PY_BIG_ENDIAN
    x = __builtin_bswap64(x);
#endif
    /* a byte is a digit when its high nibble is 3 and adding 6 keeps it 3 */
    uint64_t high = x & 0xF0F0F0F0F0F0F0F0ull;
    uint64_t carried = (x + 0x0606060606060606ull) & 0xF0F0F0F0F0F0F0F0ull;
    uint64_t not_digit = (high ^ 0x3030303030303030ull) | (carried ^ 0x3030303030303030ull);
    int n = not_digit == 0 ? 8 : __builtin_ctzll(not_digit) >> 3;
    if (n == 0) return 0;
    /* digits to the top bytes (the first, most significant, lowest), zeros below them:
     * leading zeros of an 8-digit number, converted by the usual three multiplies */
    uint64_t v = (x - 0x3030303030303030ull) << (8 * (8 - n));
    v = (v * 10) + (v >> 8);
    v = (((v & 0x000000FF000000FFull) * (100 + (1000000ull << 32))) +
         (((v >> 16) & 0x000000FF000000FFull) * (1 + (10000ull << 32)))) >> 32;
    *value = v;
    return n;
}

static const uint64_t POW10[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000,
                                  100000000};

/* The plain non-negative integer whose first digit is at p: its digit count (0 when p
 * is no digit; -1 when it is no plain integer up to `max`: a leading zero, more than 20
 * digits, past max) and its value in *out. Up to 24 digits are read 8 at a time. */
static inline int read_uint(const unsigned char *p, const unsigned char *end, uint64_t max,
                            uint64_t *out) {
    uint64_t v = 0;
    int n;
    if (end - p >= 24) {
        n = word_digits(p, &v);
        if (n == 8) {
            uint64_t w = 0, u = 0;
            int m = word_digits(p + 8, &w);
            if (m < 8) {
                v = v * POW10[m] + w; /* < 10^16 */
                n = 8 + m;
            } else {
                int k = word_digits(p + 16, &u);
                if (k > 4) return -1; /* more than 20 digits */
                uint64_t high;
                if (__builtin_mul_overflow(v, POW10[k] * POW10[8], &high) ||
                    __builtin_add_overflow(high, w * POW10[k] + u, &v)) {
                    return -1;
                }
                n = 16 + k;
            }
        }
    } else { /* near the body's end: byte by byte */
        n = 0;
        while (p + n < end && p[n] >= '0' && p[n] <= '9') {
            if (__builtin_mul_overflow(v, 10, &v) ||
                __builtin_add_overflow(v, (uint64_t)(p[n] - '0'), &v) || ++n > 20) {
                return -1;
            }
        }
    }
    if (n == 0) return 0;
    if ((n > 1 && *p == '0') || v > max) return -1;
    *out = v;
    return n;
}

/* The value of a hex digit, or -1. */
static inline int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    c |= 0x20; /* lower case */
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* The JSON string whose opening quote is at p as a block hash the way the schema's
 * pattern ^(0[xX])?[0-9a-fA-F]{1,64}$ and score_inputs.block_keys read it: 1 to 64 hex
 * digits after an optional 0x, kept to their low 64 bits (shifting left drops the
 * rest). Returns the bytes it spans, quotes included, or -1 for any other string
 * (escapes too: msgspec decides those). */
static inline int read_hex(const unsigned char *p, const unsigned char *end, uint64_t *out) {
    const unsigned char *q = p + 1;
    /* "0x" is the prefix whenever it is there: an x is no hex digit, so the pattern
     * cannot match it as digits */
    if (end - q >= 2 && q[0] == '0' && (q[1] == 'x' || q[1] == 'X')) q += 2;
    const unsigned char *digits = q;
    uint64_t v = 0;
    int d;
    while (q < end && (d = hex_value(*q)) >= 0) {
        v = (v << 4) | (uint64_t)d;
        q++;
    }
    Py_ssize_t n = q - digits;
    if (n < 1 || n > 64 || q >= end || *q != '"') return -1;
    *out = v;
    return (int)(q + 1 - p);
}

/* Where read_ids() puts the integers: native uint32 (token ids) or uint64 (hashes). */
typedef struct {
    unsigned char *out;
    int size; /* 4 or 8 */
    uint64_t max;
    int hex; /* hex strings are items too (block hashes) */
} Items;

/* One item at p into slot n: the bytes it spans (0: no item starts at p; -1: one that
 * is not what the reader takes). */
static inline int read_item(const unsigned char *p, const unsigned char *end, const Items *items,
                            Py_ssize_t n) {
    uint64_t v;
    if (items->hex && *p == '"') {
        int spanned = read_hex(p, end, &v);
        if (spanned > 0) memcpy(items->out + 8 * n, &v, 8);
        return spanned;
    }
    int digits = read_uint(p, end, items->max, &v);
    if (digits > 0) {
        if (items->size == 4) {
            uint32_t u = (uint32_t)v;
            memcpy(items->out + 4 * n, &u, 4);
        } else {
            memcpy(items->out + 8 * n, &v, 8);
        }
    }
    return digits;
}

/* The array of integers at p ('[') into items (room for every one), its count in
 * *count; past the ']', or NULL when it is anything but plain non-negative integers. */
static const unsigned char *read_ids_narrow(const unsigned char *p, const unsigned char *end,
                                            const Items *items, Py_ssize_t *count) {
    Py_ssize_t n = 0;
    p = skip_ws(p + 1, end);
    if (p < end && *p == ']') {
        *count = 0;
        return p + 1;
    }
    for (;;) {
        if (p >= end) return NULL;
        int digits = read_item(p, end, items, n);
        if (digits <= 0) return NULL;
        p += digits;
        n++;
        if (p < end && *p == ',') { /* the usual separators first: "," and ", " */
            p++;
            if (p < end && *p == ' ') p++;
            p = skip_ws(p, end);
            continue;
        }
        p = skip_ws(p, end);
        if (p >= end) return NULL;
        if (*p == ']') {
            *count = n;
            return p + 1;
        }
        if (*p != ',') return NULL; /* '.', 'e', '-' and the rest: msgspec decides */
        p = skip_ws(p + 1, end);
    }
}

#if HAVE_WIDE
/* 64 bytes at q as bit masks (bit i: byte q[i]) of digits, commas, ']' and the bytes
 * an array of ids may hold (digits, commas, JSON whitespace, ']'). */
typedef struct {
    uint64_t digit, comma, close, allowed;
} Masks;

static inline Masks masks_of(const unsigned char *q) {
    const __m128i zero = _mm_set1_epi8('0'), nine = _mm_set1_epi8(9);
    const __m128i comma = _mm_set1_epi8(','), close = _mm_set1_epi8(']');
    const __m128i space = _mm_set1_epi8(' '), tab = _mm_set1_epi8('\t');
    const __m128i nl = _mm_set1_epi8('\n'), cr = _mm_set1_epi8('\r');
    Masks m = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * i));
        __m128i t = _mm_sub_epi8(v, zero);
        __m128i d = _mm_cmpeq_epi8(_mm_max_epu8(t, nine), nine); /* t <= 9, unsigned */
        __m128i c = _mm_cmpeq_epi8(v, comma), r = _mm_cmpeq_epi8(v, close);
        __m128i w = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, space), _mm_cmpeq_epi8(v, tab)),
                                 _mm_or_si128(_mm_cmpeq_epi8(v, nl), _mm_cmpeq_epi8(v, cr)));
        __m128i ok = _mm_or_si128(_mm_or_si128(d, c), _mm_or_si128(r, w));
        int shift = 16 * i;
        m.digit |= (uint64_t)(uint16_t)_mm_movemask_epi8(d) << shift;
        m.comma |= (uint64_t)(uint16_t)_mm_movemask_epi8(c) << shift;
        m.close |= (uint64_t)(uint16_t)_mm_movemask_epi8(r) << shift;
        m.allowed |= (uint64_t)(uint16_t)_mm_movemask_epi8(ok) << shift;
    }
    return m;
}

/* Bit i: the parity of the set bits of x at or below i. */
static inline uint64_t prefix_xor(uint64_t x) {
    x ^= x << 1;
    x ^= x << 2;
    x ^= x << 4;
    x ^= x << 8;
    x ^= x << 16;
    x ^= x << 32;
    return x;
}

/* read_ids_narrow()'s answer, 64 bytes at a time: the bytes are classified with SSE2
 * first, so where each id starts is known without walking the one before it, and the
 * ids are converted independently of each other (the narrow reader waits on every
 * id's length before it can look at the next). The array is valid when it holds only
 * digits, commas and whitespace up to its ']', and the ids and commas alternate, an id
 * first and last (or neither: []). */
static const unsigned char *read_ids_wide(const unsigned char *p, const unsigned char *end,
                                          const Items *items, Py_ssize_t *count) {
    unsigned char tail[64];
    Py_ssize_t n = 0;
    uint64_t digit_carry = 0, parity = 0; /* the last byte was a digit; odd events so far */
    const unsigned char *base = p + 1;
    for (;; base += 64) {
        const unsigned char *q = base;
        if (end - base < 64) { /* the last bytes, padded with bytes no array holds */
            if (base >= end) return NULL;
            memset(tail, 0, sizeof(tail));
            memcpy(tail, base, (size_t)(end - base));
            q = tail;
        }
        Masks m = masks_of(q);
        uint64_t valid = ~0ull;
        if (m.close) {
            valid = (m.close & -m.close) - 1; /* the bytes before the first ']' */
        }
        if (~m.allowed & valid) return NULL;
        uint64_t digit = m.digit & valid, comma = m.comma & valid;
        uint64_t starts = digit & ~((digit << 1) | digit_carry);
        uint64_t events = starts | comma;
        uint64_t odd = prefix_xor(events) ^ (0ull - parity); /* events 1, 3, 5...: ids */
        if ((events & odd) != starts) return NULL;
        parity = odd >> 63; /* the parity of every event so far */
        digit_carry = digit >> 63;
        while (starts) {
            const unsigned char *at = base + __builtin_ctzll(starts);
            starts &= starts - 1;
            if (read_item(at, end, items, n++) < 0) return NULL;
        }
        if (m.close) {
            if (n > 0 && !parity) return NULL; /* a comma after the last id */
            *count = n;
            return base + __builtin_ctzll(m.close) + 1;
        }
    }
}
#endif

static const unsigned char *read_ids(const unsigned char *p, const unsigned char *end,
                                     const Items *items, Py_ssize_t *count, int wide) {
#if HAVE_WIDE
    if (wide) {
        /* the wide reader takes digits only: an array with hex strings is read narrow */
        const unsigned char *done = read_ids_wide(p, end, items, count);
        if (done != NULL || !items->hex) return done;
    }
#endif
    (void)wide;
    return read_ids_narrow(p, end, items, count);
}

static PyObject *split(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *field;
    Py_ssize_t field_len;
    if (nargs < 2 || nargs > 3 || !PyBytes_Check(args[0]) ||
        (field = PyUnicode_AsUTF8AndSize(args[1], &field_len)) == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "split(body: bytes, field: str, wide=True)");
        }
        return NULL;
    }
    Items items;
    if (strcmp(field, "token_ids") == 0) {
        items.size = 4, items.max = 0xFFFFFFFFull, items.hex = 0;
    } else if (strcmp(field, "block_hashes") == 0) {
        items.size = 8, items.max = UINT64_MAX, items.hex = 1;
    } else {
        PyErr_SetString(PyExc_ValueError, "split(): field is token_ids or block_hashes");
        return NULL;
    }
    int wide = nargs < 3 || PyObject_IsTrue(args[2]);
    PyObject *arg = args[0];
    const unsigned char *body = (const unsigned char *)PyBytes_AS_STRING(arg);
    Py_ssize_t size = PyBytes_GET_SIZE(arg);
    const unsigned char *end = body + size, *p = skip_ws(body, end);
    const unsigned char *array_at = NULL, *array_end = NULL;
    PyObject *found = NULL;
    Py_ssize_t count = 0;

    if (p >= end || *p != '{') Py_RETURN_NONE;
    p = skip_ws(p + 1, end);
    if (p < end && *p == '}') Py_RETURN_NONE;
    for (;;) {
        if (p >= end || *p != '"') goto msgspec;
        int escaped = 0;
        const unsigned char *key = p + 1, *after = skip_string(p, end, &escaped);
        if (after == NULL || escaped) goto msgspec;
        Py_ssize_t key_len = after - 1 - key;
        p = skip_ws(after, end);
        if (p >= end || *p != ':') goto msgspec;
        p = skip_ws(p + 1, end);
        if (key_len == field_len && memcmp(key, field, (size_t)field_len) == 0) {
            if (found != NULL || p >= end || *p != '[') goto msgspec; /* twice, or not [...] */
            /* each integer takes at least 2 bytes ("1,"), the last one 1 */
            found = PyBytes_FromStringAndSize(NULL, items.size * ((end - p) / 2 + 1));
            if (found == NULL) return NULL;
            items.out = (unsigned char *)PyBytes_AS_STRING(found);
            array_at = p;
            p = read_ids(p, end, &items, &count, wide);
            if (p == NULL) goto msgspec;
            array_end = p;
        } else {
            p = skip_value(p, end);
            if (p == NULL) goto msgspec;
        }
        p = skip_ws(p, end);
        if (p < end && *p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (p < end && *p == '}') break;
        goto msgspec;
    }
    if (found == NULL || skip_ws(p + 1, end) != end) goto msgspec;
    if (_PyBytes_Resize(&found, items.size * count) < 0) return NULL;

    Py_ssize_t head = array_at - body, tail = end - array_end;
    PyObject *rest = PyBytes_FromStringAndSize(NULL, head + 4 + tail);
    if (rest == NULL) {
        Py_DECREF(found);
        return NULL;
    }
    char *out = PyBytes_AS_STRING(rest);
    memcpy(out, body, head);
    memcpy(out + head, "null", 4);
    memcpy(out + head + 4, array_end, tail);
    PyObject *pair = PyTuple_Pack(2, rest, found);
    Py_DECREF(rest);
    Py_DECREF(found);
    return pair;

msgspec:
    Py_XDECREF(found);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"split", (PyCFunction)(void (*)(void))split, METH_FASTCALL,
     "split(body, field, wide=True): (the body with its top-level array `field` "
     "(token_ids or block_hashes) replaced by null, the array's integers as native uint32 "
     "or uint64 bytes), or None when msgspec must decode the whole body. wide=False reads "
     "the array byte by byte (what runs without SSE2; for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_json_tokens",
    "Compiled reader of a JSON body's token_ids or block_hashes array.", -1, methods,
};

PyMODINIT_FUNC PyInit__json_tokens(void) { return PyModule_Create(&module); }
