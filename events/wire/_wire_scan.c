/* A compiled scanner for vLLM KV-event payloads (events/wire/scanned.py wraps it).
 *
 * Why C: decoding a payload with msgspec turns every block hash into a Python int and
 * walks every token id to skip it; the ingest path needs neither. This scanner walks
 * the msgpack bytes once and yields what ingest needs: every block hash as a native
 * uint64 (no Python ints), the events grouped into runs of consecutive events whose
 * ingest-relevant fields are equal, and each event's byte span (so one event can be
 * decoded by msgspec on demand: the sampled hash check reads its token ids). merge()
 * (_wire_scan_merge.h) joins the scans of consecutive batches; drain()
 * (_wire_scan_zmq.h) receives, scans and joins them straight off a SUB socket.
 *
 * It recognises the payloads of every vLLM release from 0.9 to 0.33: a positional
 * batch [ts, events(, rank, ...)] whose events are all positional arrays (tag first,
 * <= 0.23) or all maps ("type" first, >= 0.24). The rule that keeps it exact: it
 * accepts only payloads msgspec's typed decoder (events/wire/vllm.py) accepts
 * whole, with nothing skipped, and returns the same values; for anything else -
 * a map envelope, an int timestamp, an unknown tag or medium-like oddity it does not
 * model, a negative hash, an oversized event, invalid UTF-8, a msgpack map or ext
 * inside a skipped value, trailing bytes - it returns None and the caller decodes with
 * msgspec. Being stricter than msgspec only costs speed; it is never allowed to be
 * looser.
 *
 * scan(payload, release_gil) -> None
 *     | (ts, stamps, rank, is_map, n_events, hashes, runs, spans)
 *   stamps:  bytes, native double per batch (one here): its ts;
 *   hashes:  bytes, native uint64 per block hash, in event order (BlockStored and
 *            BlockRemoved); a digest sent as bytes becomes its last 8 bytes, big-endian;
 *   runs:    tuple of (tag, first, count, start, stop, parent_none, block_size, medium,
 *            group_idx, kind, window, locality): tag 0 BlockStored, 1 BlockRemoved,
 *            2 AllBlocksCleared; events first..first+count-1; their hashes are
 *            hashes[start:stop] (in items); the other fields as events/wire/runs.py defines;
 *   spans:   bytes, native uint32 (payload, start, stop) per event: where its bytes are
 *            (payload 0 here; merge() and drain() join several payloads' scans).
 * With release_gil true the walk runs without the GIL (the Python objects are built
 * after it), so another thread can run meanwhile on another core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_wire_scan_read.h"

/* A scalar field: nil, int (want_int) or valid string (want_str). 0 or -1. */
static int read_attr(Scan *s, Attr *a, int want_int, int want_str) {
    Val v;
    switch (next(s, &v)) {
    case V_NIL:
        a->kind = A_NIL;
        return 0;
    case V_INT:
        if (!want_int) return -1;
        a->kind = A_INT, a->neg = v.neg, a->u = v.u;
        return 0;
    case V_STR:
        if (!want_str || !utf8_ok(v.data, v.len)) return -1;
        a->kind = A_STR, a->s = v.data, a->len = v.len;
        return 0;
    default:
        return -1;
    }
}

/* An int field with no None allowed (block_size). */
static int read_int(Scan *s, Attr *a) {
    Val v;
    if (next(s, &v) != V_INT) return -1;
    a->kind = A_INT, a->neg = v.neg, a->u = v.u;
    return 0;
}

/* A block hash: a non-negative int, or a digest as bytes (its last 8 bytes, big-endian). */
static inline int hash_value(const Val *v, uint64_t *out) {
    if (v->type == V_INT) {
        if (v->neg) return -1;
        *out = v->u;
        return 0;
    }
    if (v->type == V_BIN) {
        uint64_t h = 0;
        uint32_t from = v->len > 8 ? v->len - 8 : 0;
        for (uint32_t i = from; i < v->len; i++) h = (h << 8) | v->data[i];
        *out = h;
        return 0;
    }
    return -1;
}

static int read_hashes(Scan *s) {
    Val v;
    if (next(s, &v) != V_ARR || v.len > MAX_HASHES_PER_EVENT) return -1;
    uint32_t n = v.len;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *p = s->p;
        uint64_t h;
        /* The common case: a uint64 hash. */
        if (p < s->end && *p == 0xcf && s->end - p >= 9) {
            h = be64(p + 1);
            s->p = p + 9;
        } else {
            Val item;
            next(s, &item);
            if (hash_value(&item, &h) < 0) return -1;
        }
        if (push_hash(s, h) < 0) return -1;
    }
    return 0;
}

static int read_parent(Scan *s, int *none) {
    Val v;
    uint64_t ignored;
    next(s, &v);
    if (v.type == V_NIL) {
        *none = 1;
        return 0;
    }
    *none = 0;
    return hash_value(&v, &ignored);
}

/* extra_keys: None or an array (of anything skip() accepts). */
static int read_extra_keys(Scan *s) {
    const uint8_t *p = s->p;
    if (p < s->end && *p == 0xc0) {
        s->p = p + 1;
        return 0;
    }
    Val v;
    if (next(s, &v) != V_ARR) return -1;
    for (uint32_t i = 0; i < v.len; i++) {
        if (skip(s, 1) < 0) return -1;
    }
    return 0;
}

static int str_is(const Val *v, const char *want) {
    size_t n = strlen(want);
    return v->type == V_STR && v->len == n && memcmp(v->data, want, n) == 0;
}

static int tag_of(const Val *v) {
    if (str_is(v, "BlockStored")) return TAG_STORED;
    if (str_is(v, "BlockRemoved")) return TAG_REMOVED;
    if (str_is(v, "AllBlocksCleared")) return TAG_CLEARED;
    return -1;
}

/* -- fields by name and position ------------------------------------------------------ */

enum {
    F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA_KEYS, F_GROUP_IDX, F_KIND, F_WINDOW, F_LOCALITY, F_UNKNOWN
};

/* Positional fields after the tag (events/wire/vllm.py's struct field order). */
static const int STORED_FIELDS[] = {
    F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA_KEYS, F_GROUP_IDX, F_KIND, F_WINDOW, F_LOCALITY,
};
static const int REMOVED_FIELDS[] = {F_HASHES, F_MEDIUM, F_GROUP_IDX, F_LOCALITY};

static int field_named(const Val *k, int tag) {
    static const struct { const char *name; int field; } names[] = {
        {"block_hashes", F_HASHES}, {"parent_block_hash", F_PARENT},
        {"token_ids", F_TOKENS}, {"block_size", F_BLOCK_SIZE}, {"lora_id", F_LORA_ID},
        {"medium", F_MEDIUM}, {"lora_name", F_LORA_NAME}, {"extra_keys", F_EXTRA_KEYS},
        {"group_idx", F_GROUP_IDX}, {"kv_cache_spec_kind", F_KIND},
        {"kv_cache_spec_sliding_window", F_WINDOW}, {"locality", F_LOCALITY},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (str_is(k, names[i].name)) {
            int f = names[i].field;
            if (tag == TAG_STORED) return f;
            if (tag == TAG_REMOVED &&
                (f == F_HASHES || f == F_MEDIUM || f == F_GROUP_IDX || f == F_LOCALITY)) {
                return f;
            }
            return F_UNKNOWN; /* another event's field: ignored, as msgspec does */
        }
    }
    return F_UNKNOWN;
}

/* Read one field's value into the event's key. */
static int read_field(Scan *s, int field, Key *key) {
    switch (field) {
    case F_HASHES: return read_hashes(s);
    case F_PARENT: return read_parent(s, &key->parent_none);
    case F_TOKENS: return skip(s, 0);
    case F_BLOCK_SIZE: return read_int(s, &key->block_size);
    case F_LORA_ID: { Attr a; return read_attr(s, &a, 1, 0); }
    case F_MEDIUM: return read_attr(s, &key->medium, 0, 1);
    case F_LORA_NAME: { Attr a; return read_attr(s, &a, 0, 1); }
    case F_EXTRA_KEYS: return read_extra_keys(s);
    case F_GROUP_IDX: return read_attr(s, &key->group_idx, 1, 0);
    case F_KIND: return read_attr(s, &key->kind, 0, 1);
    case F_WINDOW: return read_attr(s, &key->window, 1, 0);
    case F_LOCALITY: return read_attr(s, &key->locality, 0, 1);
    default: return skip(s, 0);
    }
}

static void key_defaults(Key *key, int tag) {
    memset(key, 0, sizeof(*key));
    key->tag = tag;
    key->parent_none = tag == TAG_STORED; /* parent_block_hash defaults to None */
    if (tag == TAG_STORED) {
        key->block_size.kind = A_INT; /* block_size defaults to 0 */
    }
}

static int attr_eq(const Attr *a, const Attr *b) {
    if (a->kind != b->kind) return 0;
    if (a->kind == A_INT) return a->u == b->u && a->neg == b->neg;
    if (a->kind == A_STR) return a->len == b->len && memcmp(a->s, b->s, a->len) == 0;
    return 1;
}

static int key_eq(const Key *a, const Key *b) {
    return a->tag == b->tag && a->parent_none == b->parent_none &&
           attr_eq(&a->block_size, &b->block_size) && attr_eq(&a->medium, &b->medium) &&
           attr_eq(&a->group_idx, &b->group_idx) && attr_eq(&a->kind, &b->kind) &&
           attr_eq(&a->window, &b->window) && attr_eq(&a->locality, &b->locality);
}

static int read_event(Scan *s, uint32_t index) {
    Val v;
    Key key;
    uint32_t start = (uint32_t)s->n_hashes;
    uint32_t at = (uint32_t)(s->p - s->base);
    int has_hashes = 0;
    next(s, &v);
    if (v.type == V_ARR) {
        if (s->is_map == 1 || v.len < 1) return -1;
        s->is_map = 0;
        uint32_t n = v.len;
        Val t;
        next(s, &t);
        int tag = tag_of(&t);
        if (tag < 0) return -1;
        key_defaults(&key, tag);
        const int *fields = tag == TAG_STORED ? STORED_FIELDS : REMOVED_FIELDS;
        uint32_t known = tag == TAG_STORED ? 12 : tag == TAG_REMOVED ? 4 : 0;
        for (uint32_t i = 1; i < n; i++) {
            int field = i - 1 < known ? fields[i - 1] : F_UNKNOWN;
            if (read_field(s, field, &key) < 0) return -1;
            has_hashes |= field == F_HASHES;
        }
    } else if (v.type == V_MAP) {
        if (s->is_map == 0 || v.len < 1) return -1;
        s->is_map = 1;
        uint32_t n = v.len;
        Val k, t;
        next(s, &k);
        if (!str_is(&k, "type")) return -1; /* vLLM writes the tag first */
        next(s, &t);
        int tag = tag_of(&t);
        if (tag < 0) return -1;
        key_defaults(&key, tag);
        uint32_t seen = 0; /* bit per known field: a repeated key is refused */
        for (uint32_t i = 1; i < n; i++) {
            next(s, &k);
            if (k.type != V_STR || !utf8_ok(k.data, k.len) || str_is(&k, "type")) return -1;
            int field = field_named(&k, tag);
            if (field != F_UNKNOWN) {
                if (seen & (1u << field)) return -1;
                seen |= 1u << field;
            }
            if (read_field(s, field, &key) < 0) return -1;
            has_hashes |= field == F_HASHES;
        }
    } else {
        return -1;
    }
    if (key.tag != TAG_CLEARED && !has_hashes) return -1; /* block_hashes is required */
    if (push_span(s, at, (uint32_t)(s->p - s->base)) < 0) return -1;
    if (s->n_runs && key_eq(&s->runs[s->n_runs - 1].key, &key)) {
        Run *run = &s->runs[s->n_runs - 1];
        run->count++;
        run->stop = (uint32_t)s->n_hashes;
        return 0;
    }
    if (s->n_runs == s->cap_runs &&
        grow((void **)&s->runs, &s->cap_runs, &s->own_runs, sizeof(Run)) < 0) {
        return -1;
    }
    Run *run = &s->runs[s->n_runs++];
    run->key = key;
    run->first = index;
    run->count = 1;
    run->start = start;
    run->stop = (uint32_t)s->n_hashes;
    return 0;
}

/* The whole walk; touches no Python object. 0, or -1: not a payload this scanner takes. */
static int walk(Scan *s) {
    Val v;
    if (next(s, &v) != V_ARR || v.len < 2) return -1;
    uint32_t n = v.len;
    Val ts;
    if (next(s, &ts) != V_FLOAT) return -1;
    s->ts = ts.f;
    Val events;
    if (next(s, &events) != V_ARR) return -1;
    for (uint32_t i = 0; i < events.len; i++) {
        if (read_event(s, i) < 0) return -1;
    }
    if (n >= 3) {
        Attr rank;
        if (read_attr(s, &rank, 1, 0) < 0) return -1;
        if (rank.kind == A_INT) {
            if (rank.neg || rank.u > MAX_DP_RANK) return -1;
            s->has_rank = 1;
            s->rank = rank.u;
        }
    }
    for (uint32_t i = 3; i < n; i++) {
        if (skip(s, 0) < 0) return -1; /* later fields msgspec ignores */
    }
    return s->p == s->end ? 0 : -1;
}

/* -- Python objects --------------------------------------------------------------------- */

static PyObject *attr_object(const Attr *a) {
    if (a->kind == A_INT) {
        return a->neg ? PyLong_FromLongLong((long long)(int64_t)a->u)
                      : PyLong_FromUnsignedLongLong(a->u);
    }
    if (a->kind == A_STR) {
        return PyUnicode_DecodeUTF8((const char *)a->s, a->len, "strict");
    }
    Py_RETURN_NONE;
}

static PyObject *run_object(const Run *r) {
    const Key *k = &r->key;
    PyObject *t = PyTuple_New(12);
    if (t == NULL) return NULL;
    PyObject *items[12];
    items[0] = PyLong_FromLong(k->tag);
    items[1] = PyLong_FromUnsignedLong(r->first);
    items[2] = PyLong_FromUnsignedLong(r->count);
    items[3] = PyLong_FromUnsignedLong(r->start);
    items[4] = PyLong_FromUnsignedLong(r->stop);
    items[5] = PyBool_FromLong(k->parent_none);
    if (k->tag == TAG_STORED) {
        items[6] = attr_object(&k->block_size);
    } else {
        items[6] = Py_NewRef(Py_None);
    }
    items[7] = attr_object(&k->medium);
    items[8] = attr_object(&k->group_idx);
    items[9] = attr_object(&k->kind);
    items[10] = attr_object(&k->window);
    items[11] = attr_object(&k->locality);
    for (int i = 0; i < 12; i++) {
        if (items[i] == NULL) {
            for (int j = 0; j < 12; j++) Py_XDECREF(items[j]);
            Py_DECREF(t);
            return NULL;
        }
    }
    for (int i = 0; i < 12; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

/* The scan as Python objects: (ts, stamps, rank, is_map, n_events, hashes, runs, spans);
 * stamps holds `n_stamps` native doubles (each batch's ts), ts the last one. */
static PyObject *result(Scan *s, const double *stamps, size_t n_stamps) {
    PyObject *ts = NULL, *rank = NULL, *hashes = NULL, *runs = NULL, *spans = NULL;
    ts = PyBytes_FromStringAndSize((const char *)stamps, n_stamps * sizeof(double));
    PyObject *last = ts == NULL ? NULL : PyFloat_FromDouble(stamps[n_stamps - 1]);
    if (last == NULL) {
        Py_XDECREF(ts);
        return NULL;
    }
    rank = s->has_rank ? PyLong_FromUnsignedLongLong(s->rank) : Py_NewRef(Py_None);
    hashes = PyBytes_FromStringAndSize((const char *)s->hashes, s->n_hashes * 8);
    spans = PyBytes_FromStringAndSize((const char *)s->spans, s->n_spans * 4);
    runs = PyTuple_New((Py_ssize_t)s->n_runs);
    if (rank == NULL || hashes == NULL || spans == NULL || runs == NULL) {
        goto fail;
    }
    for (size_t i = 0; i < s->n_runs; i++) {
        PyObject *r = run_object(&s->runs[i]);
        if (r == NULL) goto fail;
        PyTuple_SET_ITEM(runs, (Py_ssize_t)i, r);
    }
    return Py_BuildValue("(NNNOnNNN)", last, ts, rank, s->is_map == 1 ? Py_True : Py_False,
                         (Py_ssize_t)(s->n_spans / 3), hashes, runs, spans);
fail:
    Py_DECREF(last);
    Py_XDECREF(ts);
    Py_XDECREF(rank);
    Py_XDECREF(hashes);
    Py_XDECREF(spans);
    Py_XDECREF(runs);
    return NULL;
}

/* A scan with its first buffers on the caller's stack. */
#define SCAN_BUFFERS                                                                    \
    uint64_t hashes_[1024];                                                             \
    Run runs_[32];                                                                      \
    uint32_t spans_[192]
#define SCAN_INIT(s)                                                                    \
    memset(&(s), 0, sizeof(s));                                                         \
    (s).hashes = hashes_, (s).cap_hashes = 1024;                                         \
    (s).runs = runs_, (s).cap_runs = 32;                                                 \
    (s).spans = spans_, (s).cap_spans = 192;                                             \
    (s).is_map = -1

static void scan_free(Scan *s) {
    if (s->own_hashes) free(s->hashes);
    if (s->own_runs) free(s->runs);
    if (s->own_spans) free(s->spans);
}

/* Start reading `len` bytes at `data` (the buffers keep what earlier payloads left). */
static void scan_payload(Scan *s, const uint8_t *data, size_t len) {
    s->base = s->p = data;
    s->end = data + len;
    s->has_rank = 0, s->rank = 0, s->ts = 0.0;
}

static PyObject *wire_scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    int release_gil = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &view, &release_gil)) {
        return NULL;
    }
    if (view.len > (Py_ssize_t)UINT32_MAX) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    SCAN_BUFFERS;
    Scan s;
    SCAN_INIT(s);
    scan_payload(&s, (const uint8_t *)view.buf, (size_t)view.len);
    int status;
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        status = walk(&s);
        Py_END_ALLOW_THREADS
    } else {
        status = walk(&s);
    }
    PyObject *out = status < 0 ? Py_NewRef(Py_None) : result(&s, &s.ts, 1);
    scan_free(&s);
    PyBuffer_Release(&view);
    return out;
}

#include "_wire_scan_merge.h"
#include "_wire_scan_zmq.h"

static PyMethodDef methods[] = {
    {"bind", zmq_bind, METH_VARARGS,
     "bind(module_path): look up libzmq's functions through pyzmq's loaded backend "
     "module; returns libzmq's (major, minor, patch)."},
    {"drain", zmq_drain, METH_VARARGS,
     "drain(socket, limit, max_payload, peer, group_max): up to `limit` messages off a "
     "SUB socket, scanned and grouped (see _wire_scan_zmq.h)."},
    {"merge", wire_merge, METH_VARARGS,
     "merge(hashes, runs, spans, parts): the scans of consecutive batches as one "
     "(hashes, runs, spans)."},
    {"scan", wire_scan, METH_VARARGS,
     "scan(payload, release_gil=False): hashes, runs and spans of a vLLM KV-event "
     "batch, or None when msgspec must decode it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wire_scan", "Compiled scanner of vLLM KV-event payloads.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__wire_scan(void) { return PyModule_Create(&module); }
