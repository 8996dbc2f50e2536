/* RESP replies read straight from the bytes a Redis lookup got back
 * (indexer/redis/_redis_lookup.c's half that knows the wire; one translation unit).
 *
 * Three readers over one buffer, none of which makes a Python object per block:
 * - resp_skip: where one whole reply ends (or that it has not all arrived yet), for
 *   the read loop's "is the transaction's answer complete?";
 * - resp_value: one reply as Python objects, for the rare answer the lookup's own
 *   reader does not take (an error inside the transaction, RESP3 maps, an aborted EXEC);
 * - the lookup's own reader (parse_lookup in _redis_lookup.c) uses resp_line and
 *   resp_bulk to walk MULTI/EXEC's answer and copy each bitmap into its row.
 *
 * Types read: + - : $ * (RESP2), % ~ _ # (RESP3 maps, sets, null, boolean: what the
 * commands of a lookup can answer over either protocol). Anything else is a protocol
 * error: the connection is not speaking to a Redis that kvindex understands.
 */
#ifndef KVINDEX_REDIS_RESP_H
#define KVINDEX_REDIS_RESP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Nesting a lookup's replies never reach (EXEC's array of HMGET arrays is 2 deep). */
#define RESP_MAX_DEPTH 8

/* Outcomes of the readers besides a position. */
#define RESP_INCOMPLETE (-1)
#define RESP_BAD (-2)

/* The end of the line starting at p (the position of its "\r"), or NULL when the
 * buffer stops before one. */
static const char *resp_eol(const char *p, const char *end) {
    const char *r = p;
    while (r + 1 < end) {
        r = memchr(r, '\r', (size_t)(end - r - 1));
        if (r == NULL) {
            return NULL;
        }
        if (r[1] == '\n') {
            return r;
        }
        r++;
    }
    return NULL;
}

/* The integer of a length or ':' line between p and eol; RESP_BAD unless it is one. */
static int resp_int(const char *p, const char *eol, long long *out) {
    int negative = 0;
    unsigned long long v = 0;
    if (p < eol && *p == '-') {
        negative = 1;
        p++;
    }
    /* hiredis's grammar: no '+', no leading zero, no "-0" */
    if (p == eol || eol - p > 19 || (*p == '0' && (eol - p > 1 || negative))) {
        return RESP_BAD;
    }
    for (; p < eol; p++) {
        if (*p < '0' || *p > '9') {
            return RESP_BAD;
        }
        v = v * 10 + (unsigned long long)(*p - '0');
    }
    if (v > (unsigned long long)INT64_MAX) {
        return RESP_BAD;
    }
    *out = negative ? -(long long)v : (long long)v;
    return 0;
}

/* One reply's header at buf[at]: its type byte, its line's integer (lengths, counts;
 * 0 for + - _ #), where its line's text starts and where the line ends; returns the
 * position after the line, RESP_INCOMPLETE or RESP_BAD. */
static Py_ssize_t resp_line(const char *buf, Py_ssize_t at, Py_ssize_t end, char *type,
                            long long *n, const char **text, const char **eol) {
    if (at >= end) {
        return RESP_INCOMPLETE;
    }
    const char *p = buf + at, *e = resp_eol(p + 1, buf + end);
    if (e == NULL) {
        return RESP_INCOMPLETE;
    }
    *type = *p;
    *text = p + 1;
    *eol = e;
    *n = 0;
    switch (*p) {
    case '$': case '*': case '%': case '~': case ':':
        if (resp_int(p + 1, e, n) < 0) {
            return RESP_BAD;
        }
        if (*p != ':' && *n < -1) {
            return RESP_BAD;
        }
        if (*p == '%' && *n > INT64_MAX / 2) { /* its items, keys and values, counted */
            return RESP_BAD;
        }
        break;
    case '+': case '-': /* one line: a lone \r or \n inside is not RESP (hiredis refuses it) */
        if (memchr(p + 1, '\r', (size_t)(e - p - 1)) || memchr(p + 1, '\n', (size_t)(e - p - 1))) {
            return RESP_BAD;
        }
        break;
    case '_': /* the whole line is the type byte, as hiredis reads RESP3's null */
        if (e != p + 1) {
            return RESP_BAD;
        }
        break;
    case '#':
        if (e != p + 2 || (p[1] != 't' && p[1] != 'f')) {
            return RESP_BAD;
        }
        break;
    default:
        return RESP_BAD;
    }
    return (e - buf) + 2;
}

/* A bulk string's body after its header line at ``at`` (length n >= 0): where the
 * reply ends, RESP_INCOMPLETE or RESP_BAD. */
static Py_ssize_t resp_bulk_end(const char *buf, Py_ssize_t at, Py_ssize_t end, long long n) {
    if (n > (long long)(PY_SSIZE_T_MAX / 2)) {
        return RESP_BAD;
    }
    if (at + (Py_ssize_t)n + 2 > end) {
        return RESP_INCOMPLETE;
    }
    if (buf[at + n] != '\r' || buf[at + n + 1] != '\n') {
        return RESP_BAD;
    }
    return at + (Py_ssize_t)n + 2;
}

/* Where the reply starting at ``at`` ends: a position, RESP_INCOMPLETE or RESP_BAD. */
static Py_ssize_t resp_skip(const char *buf, Py_ssize_t at, Py_ssize_t end, int depth) {
    char type;
    long long n;
    const char *text, *eol;
    if (depth > RESP_MAX_DEPTH) {
        return RESP_BAD;
    }
    Py_ssize_t next = resp_line(buf, at, end, &type, &n, &text, &eol);
    if (next < 0) {
        return next;
    }
    if (type == '$') {
        return n < 0 ? next : resp_bulk_end(buf, next, end, n);
    }
    if (type == '*' || type == '~' || type == '%') {
        long long items = type == '%' && n > 0 ? 2 * n : n;
        for (long long i = 0; i < items; i++) {
            next = resp_skip(buf, next, end, depth + 1);
            if (next < 0) {
                return next;
            }
        }
    }
    return next;
}

/* One reply as Python objects (bytes for strings and status lines, as hiredis gives
 * them; error_factory(message) for an error; int; None; list; dict; bool); *at moves
 * past it. NULL with an exception set on failure (ValueError for a malformed reply:
 * resp_skip has already said it is whole). */
static PyObject *resp_value(const char *buf, Py_ssize_t *at, Py_ssize_t end,
                            PyObject *error_factory, int depth) {
    char type;
    long long n;
    const char *text, *eol;
    Py_ssize_t next = depth > RESP_MAX_DEPTH ? RESP_BAD
                                             : resp_line(buf, *at, end, &type, &n, &text, &eol);
    if (next < 0) {
        PyErr_SetString(PyExc_ValueError, "malformed or incomplete RESP reply");
        return NULL;
    }
    *at = next;
    switch (type) {
    case '+':
        return PyBytes_FromStringAndSize(text, eol - text);
    case '-': {
        PyObject *message = PyUnicode_DecodeUTF8(text, eol - text, "replace");
        if (message == NULL) {
            return NULL;
        }
        PyObject *error = PyObject_CallOneArg(error_factory, message);
        Py_DECREF(message);
        return error;
    }
    case ':':
        return PyLong_FromLongLong(n);
    case '_':
        Py_RETURN_NONE;
    case '#': /* resp_line checked it is t or f */
        return PyBool_FromLong(*text == 't');
    case '$': {
        if (n < 0) {
            Py_RETURN_NONE;
        }
        Py_ssize_t stop = resp_bulk_end(buf, next, end, n);
        if (stop < 0) {
            PyErr_SetString(PyExc_ValueError, "malformed or incomplete RESP bulk string");
            return NULL;
        }
        *at = stop;
        return PyBytes_FromStringAndSize(buf + next, (Py_ssize_t)n);
    }
    default: /* '*', '~', '%' */
        break;
    }
    if (n < 0) {
        Py_RETURN_NONE;
    }
    if (type == '%') {
        PyObject *map = PyDict_New();
        for (long long i = 0; map != NULL && i < n; i++) {
            PyObject *key = resp_value(buf, at, end, error_factory, depth + 1);
            PyObject *value = key ? resp_value(buf, at, end, error_factory, depth + 1) : NULL;
            if (value == NULL || PyDict_SetItem(map, key, value) < 0) {
                Py_CLEAR(map);
            }
            Py_XDECREF(key);
            Py_XDECREF(value);
        }
        return map;
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (long long i = 0; list != NULL && i < n; i++) {
        PyObject *item = resp_value(buf, at, end, error_factory, depth + 1);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return list;
}

#endif
