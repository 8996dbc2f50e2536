/* The token ids of a JSON /score or /route body read straight into uint32s
 * (api/json_tokens.py wraps it).
 *
 * Why C: msgspec decodes an 8,192-token body's array into 8,192 Python ints (~90 ns
 * each, ~0.75 ms of the request), and the compiled hash chain then reads them back one
 * by one. Here the array's digits become native uint32s in one pass, and msgspec
 * decodes what is left of the body, with the array replaced by null (a few dozen
 * bytes); the caller sets the field to the array afterwards.
 *
 * split(body, wide=True) -> None | (rest, tokens)
 *   rest:   the body with the top-level "token_ids" array replaced by null;
 *   tokens: bytes, the ids as native uint32, in order;
 *   wide:   read the array 64 bytes at a time with SSE2 (x86-64; elsewhere, and with
 *           wide=False, byte by byte: the same answers, tests compare them).
 *
 * The rule that keeps it exact: it answers only for a body whose "token_ids" msgspec
 * would decode into the same ids, and leaves everything else to msgspec. It returns None
 * (decode the whole body with msgspec) unless the body is one JSON object whose
 * top-level keys are plain (no backslash escape), with "token_ids" given exactly once
 * and its value an array of plain non-negative integers (digits only, no leading zero,
 * no fraction or exponent, at most 2**32 - 1). Being stricter than msgspec only costs
 * speed. Anything wrong elsewhere in the body (a bad field, malformed JSON after the
 * array) is still in the rest, so msgspec rejects the rest and the caller decodes the
 * whole body to give msgspec's own error for it.
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

#define TOKEN_MAX 0xFFFFFFFFull

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

/* The digits at p as a number: how many there are (0..8 counted in one word; 8 means
 * "8 or more") and, when fewer than 8, their value. Needs 8 readable bytes at p. */
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
    if (not_digit == 0) return 8;
    int n = __builtin_ctzll(not_digit) >> 3;
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

/* The id whose first digit is at p: its digit count (0 when p is no digit, -1 when it
 * is no plain uint32: a leading zero, more than 10 digits, past 2**32 - 1) and value. */
static inline int read_id(const unsigned char *p, const unsigned char *end, uint32_t *out) {
    uint64_t v = 0;
    int digits = end - p >= 8 ? word_digits(p, &v) : -1;
    if (digits < 0 || digits == 8) { /* near the end, or a long number: byte by byte */
        v = 0;
        digits = 0;
        while (p + digits < end && p[digits] >= '0' && p[digits] <= '9') {
            v = v * 10 + (uint64_t)(p[digits] - '0');
            if (++digits > 10) return -1;
        }
        if (v > TOKEN_MAX) return -1;
    }
    if (digits > 1 && *p == '0') return -1;
    *out = (uint32_t)v;
    return digits;
}

/* The array of ints at p ('[') into out (room for every id), its count in *count;
 * past the ']', or NULL when it is anything but plain non-negative integers. */
static const unsigned char *read_ids_narrow(const unsigned char *p, const unsigned char *end,
                                     uint32_t *out, Py_ssize_t *count) {
    Py_ssize_t n = 0;
    p = skip_ws(p + 1, end);
    if (p < end && *p == ']') {
        *count = 0;
        return p + 1;
    }
    for (;;) {
        if (p >= end) return NULL;
        int digits = read_id(p, end, &out[n]);
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
                                          uint32_t *out, Py_ssize_t *count) {
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
            if (read_id(at, end, &out[n++]) < 0) return NULL;
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
                                     uint32_t *out, Py_ssize_t *count, int wide) {
#if HAVE_WIDE
    if (wide) return read_ids_wide(p, end, out, count);
#endif
    (void)wide;
    return read_ids_narrow(p, end, out, count);
}

static PyObject *split(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "split(body: bytes, wide: bool = True)");
        return NULL;
    }
    PyObject *arg = args[0];
    int wide = nargs < 2 || PyObject_IsTrue(args[1]);
    const unsigned char *body = (const unsigned char *)PyBytes_AS_STRING(arg);
    Py_ssize_t size = PyBytes_GET_SIZE(arg);
    const unsigned char *end = body + size, *p = skip_ws(body, end);
    const unsigned char *array_at = NULL, *array_end = NULL;
    PyObject *tokens = NULL;
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
        if (key_len == 9 && memcmp(key, "token_ids", 9) == 0) {
            if (tokens != NULL || p >= end || *p != '[') goto msgspec; /* twice, or not [...] */
            /* each id takes at least 2 bytes ("1,"), the last one 1 */
            tokens = PyBytes_FromStringAndSize(NULL, 4 * ((end - p) / 2 + 1));
            if (tokens == NULL) return NULL;
            array_at = p;
            p = read_ids(p, end, (uint32_t *)PyBytes_AS_STRING(tokens), &count, wide);
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
    if (tokens == NULL || skip_ws(p + 1, end) != end) goto msgspec;
    if (_PyBytes_Resize(&tokens, 4 * count) < 0) return NULL;

    Py_ssize_t head = array_at - body, tail = end - array_end;
    PyObject *rest = PyBytes_FromStringAndSize(NULL, head + 4 + tail);
    if (rest == NULL) {
        Py_DECREF(tokens);
        return NULL;
    }
    char *out = PyBytes_AS_STRING(rest);
    memcpy(out, body, head);
    memcpy(out + head, "null", 4);
    memcpy(out + head + 4, array_end, tail);
    PyObject *pair = PyTuple_Pack(2, rest, tokens);
    Py_DECREF(rest);
    Py_DECREF(tokens);
    return pair;

msgspec:
    Py_XDECREF(tokens);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"split", (PyCFunction)(void (*)(void))split, METH_FASTCALL,
     "split(body, wide=True): (the body with its top-level token_ids array replaced by "
     "null, the ids as native uint32 bytes), or None when msgspec must decode the whole "
     "body. wide=False reads the array byte by byte (what runs without SSE2; for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_json_tokens",
    "Compiled reader of a JSON body's token_ids array.", -1, methods,
};

PyMODINIT_FUNC PyInit__json_tokens(void) { return PyModule_Create(&module); }
