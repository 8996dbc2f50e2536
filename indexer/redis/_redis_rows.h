/* The lookup's answer as a matrix of bitmaps, and the walk over it
 * (indexer/redis/_redis_lookup.c's second half; one translation unit).
 *
 * The matrix: one row per looked-up key, in key order; per row ``per_key`` slots (GPU,
 * or GPU, CPU, STORAGE) of ``width`` bytes, each the member bitmap Redis holds for that
 * field (bit ``id % 8`` of byte ``id // 8``), zero-padded; a field Redis does not hold is
 * all zeros. redis_read.rows_of builds the same bytes from parsed replies.
 */
#ifndef KVINDEX_REDIS_ROWS_H
#define KVINDEX_REDIS_ROWS_H

typedef struct {
    const char *at;
    Py_ssize_t len;
} Value;

/* A status line equal to ``want`` at *at; moves *at past it. */
static int expect_status(const char *buf, Py_ssize_t *at, Py_ssize_t end, const char *want) {
    char type;
    long long n;
    const char *text, *eol;
    Py_ssize_t next = resp_line(buf, *at, end, &type, &n, &text, &eol);
    size_t len = strlen(want);
    if (next < 0 || type != '+' || (size_t)(eol - text) != len || memcmp(text, want, len)) {
        return -1;
    }
    *at = next;
    return 0;
}

/* An array header at *at: its count (>= 0), or -1 for anything else. With ``maps``
 * a RESP3 map counts as the array of its keys and values (HGETALL over RESP3). */
static long long expect_array(const char *buf, Py_ssize_t *at, Py_ssize_t end, int maps) {
    char type;
    long long n;
    const char *text, *eol;
    Py_ssize_t next = resp_line(buf, *at, end, &type, &n, &text, &eol);
    if (next < 0 || n < 0 || (type != '*' && !(maps && type == '%'))) {
        return -1;
    }
    *at = next;
    return type == '%' ? 2 * n : n;
}

/* A bulk string or nil (RESP2's $-1, RESP3's _) at *at (nil: v->at NULL); -1 for
 * anything else. */
static int expect_bulk(const char *buf, Py_ssize_t *at, Py_ssize_t end, Value *v) {
    char type;
    long long n;
    const char *text, *eol;
    Py_ssize_t next = resp_line(buf, *at, end, &type, &n, &text, &eol);
    if (next < 0 || (type != '$' && type != '_')) {
        return -1;
    }
    if (type == '_' || n < 0) {
        v->at = NULL;
        v->len = 0;
        *at = next;
        return 0;
    }
    Py_ssize_t stop = resp_bulk_end(buf, next, end, n);
    if (stop < 0) {
        return -1;
    }
    v->at = buf + next;
    v->len = (Py_ssize_t)n;
    *at = stop;
    return 0;
}

/* A head reply (an array of bulk strings or nils) as a list of bytes and None; a
 * RESP3 map as the flat list of its keys and values, as RESP2 sends HGETALL's. */
static PyObject *head_list(const char *buf, Py_ssize_t *at, Py_ssize_t end, int *unexpected) {
    long long n = expect_array(buf, at, end, 1);
    if (n < 0) {
        *unexpected = 1;
        return NULL;
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (long long i = 0; list != NULL && i < n; i++) {
        Value v;
        if (expect_bulk(buf, at, end, &v) < 0) {
            *unexpected = 1;
            Py_CLEAR(list);
            break;
        }
        PyObject *item = v.at ? PyBytes_FromStringAndSize(v.at, v.len) : Py_NewRef(Py_None);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return list;
}

PyDoc_STRVAR(parse_lookup_doc,
"parse_lookup(buffer, end, heads, commands, order, per_key) -> (heads, rows, width) | None\n\n"
"MULTI/EXEC's answer in buffer[:end] (``heads`` small reads, then ``commands`` HMGETs\n"
"packed by pack_reads, whose ``order`` it was): the heads' replies as lists of bytes\n"
"and None (a map as its flat list of keys and values), and the bitmaps as the\n"
"key-order matrix (see above). Over RESP2 or RESP3. None when the answer is not what a\n"
"clean lookup gets (an error reply, an aborted EXEC, counts that do not add up): then\n"
"the caller reads it with decode().");

static PyObject *parse_lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t end, heads, commands, per_key;
    Py_buffer view;
    if (nargs != 6 || !PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "parse_lookup(buffer, end, heads, commands, order: bytes, per_key)");
        return NULL;
    }
    if ((end = PyLong_AsSsize_t(args[1])) == -1 || (heads = PyLong_AsSsize_t(args[2])) == -1 ||
        (commands = PyLong_AsSsize_t(args[3])) == -1 ||
        (per_key = PyLong_AsSsize_t(args[5])) == -1) {
        return NULL;
    }
    if (per_key != 1 && per_key != 3) {
        PyErr_SetString(PyExc_ValueError, "per_key must be 1 or 3");
        return NULL;
    }
    const int32_t *order = (const int32_t *)PyBytes_AS_STRING(args[4]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[4]) / (Py_ssize_t)sizeof(int32_t);
    Py_ssize_t values = n * per_key;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (order[i] < 0 || order[i] >= n) {
            PyErr_SetString(PyExc_ValueError, "order is not a permutation of the keys");
            return NULL;
        }
    }
    if (read_buffer(args[0], end, &view) < 0) {
        return NULL;
    }
    const char *buf = view.buf;
    Py_ssize_t at = 0;
    int unexpected = 0;
    PyObject *head_replies = NULL, *rows = NULL, *result = NULL;
    Value *found = PyMem_Malloc(sizeof(Value) * (size_t)(values ? values : 1));
    if (found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unexpected = expect_status(buf, &at, end, "OK") < 0;
    for (Py_ssize_t i = 0; !unexpected && i < heads + commands; i++) {
        unexpected = expect_status(buf, &at, end, "QUEUED") < 0;
    }
    if (unexpected || expect_array(buf, &at, end, 0) != heads + commands) {
        unexpected = 1;
        goto done;
    }
    head_replies = PyList_New(heads);
    for (Py_ssize_t i = 0; head_replies != NULL && i < heads; i++) {
        PyObject *head = head_list(buf, &at, end, &unexpected);
        if (head == NULL) {
            goto done;
        }
        PyList_SET_ITEM(head_replies, i, head);
    }
    if (head_replies == NULL) {
        goto done;
    }
    Py_ssize_t got = 0, width = 0;
    for (Py_ssize_t c = 0; c < commands; c++) {
        long long fields = expect_array(buf, &at, end, 0);
        if (fields < 0 || fields > values - got) {
            unexpected = 1;
            goto done;
        }
        for (long long f = 0; f < fields; f++, got++) {
            if (expect_bulk(buf, &at, end, &found[got]) < 0) {
                unexpected = 1;
                goto done;
            }
            if (found[got].len > width) {
                width = found[got].len;
            }
        }
    }
    if (got != values) {
        unexpected = 1;
        goto done;
    }
    rows = PyBytes_FromStringAndSize(NULL, values * width);
    if (rows == NULL) {
        goto done;
    }
    char *out = PyBytes_AS_STRING(rows);
    memset(out, 0, (size_t)(values * width));
    for (Py_ssize_t j = 0; j < values; j++) {
        if (found[j].at != NULL) {
            Py_ssize_t row = order[j / per_key] * per_key + j % per_key;
            memcpy(out + row * width, found[j].at, (size_t)found[j].len);
        }
    }
    result = Py_BuildValue("(OOn)", head_replies, rows, width);
done:
    PyMem_Free(found);
    PyBuffer_Release(&view);
    Py_XDECREF(head_replies);
    Py_XDECREF(rows);
    if (unexpected && !PyErr_Occurred()) {
        Py_XDECREF(result);
        Py_RETURN_NONE;
    }
    return result;
}

/* -- the walk ---------------------------------------------------------------------------- */

/* Slot ``slot`` of row ``row`` as 64-bit words, bit m = member id m. */
static void load_words(const unsigned char *rows, Py_ssize_t row, Py_ssize_t per_key,
                       Py_ssize_t slot, Py_ssize_t width, uint64_t *out, Py_ssize_t words) {
    const unsigned char *p = rows + (row * per_key + slot) * width;
    memset(out, 0, sizeof(uint64_t) * (size_t)words);
    for (Py_ssize_t b = 0; b < width; b++) {
        out[b / 8] |= (uint64_t)p[b] << (8 * (b % 8));
    }
}

/* counts[m] += by for every set bit m of bits. */
static void add_bits(const uint64_t *bits, Py_ssize_t words, int64_t *counts, int64_t by) {
    for (Py_ssize_t w = 0; w < words; w++) {
        uint64_t x = bits[w];
        while (x) {
            counts[w * 64 + __builtin_ctzll(x)] += by;
            x &= x - 1;
        }
    }
}

typedef struct {
    int64_t length, gpu, rank;
    Py_ssize_t member;
} Found;

/* The view's rank array (int64 per member id) as a buffer. */
static int get_rank(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '=' || *f == '<' || *f == '@') {
        f++;
    }
    if (view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "rank must be int64");
        return -1;
    }
    return 0;
}

/* allowed[m] = 1 for each member id m < bits in ``ids`` (every id when None). */
static int allowed_ids(PyObject *ids, unsigned char *allowed, Py_ssize_t bits) {
    if (ids == Py_None) {
        memset(allowed, 1, (size_t)bits);
        return 0;
    }
    PyObject *seq = PySequence_Fast(ids, "allowed must be a sequence of ids");
    if (seq == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t mid = PyLong_AsSsize_t(PySequence_Fast_ITEMS(seq)[i]);
        if (mid == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (mid >= 0 && mid < bits) {
            allowed[mid] = 1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static int best_first(const void *a, const void *b) {
    const Found *x = a, *y = b;
    if (x->length != y->length) {
        return x->length > y->length ? -1 : 1;
    }
    if (x->gpu != y->gpu) {
        return x->gpu > y->gpu ? -1 : 1;
    }
    return (x->rank > y->rank) - (x->rank < y->rank);
}

PyDoc_STRVAR(prefix_walk_doc,
"prefix_walk(rows, per_key, width, rank, names, allowed, match) -> list\n\n"
"Each member's longest held prefix of the matrix's keys, as match(name, blocks,\n"
"(gpu, cpu, storage)), longest first, then most on GPU, then by ``rank`` (int64 per\n"
"member id: its place in name order, -1 for an id without a name, which is left out).\n"
"``names``: the member name per id; ``allowed``: member ids to answer for, or None.");

static PyObject *prefix_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t per_key, width;
    if (nargs != 7 || !PyBytes_Check(args[0]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "prefix_walk(rows: bytes, per_key, width, rank, names: list, allowed, "
                        "match)");
        return NULL;
    }
    if ((per_key = PyLong_AsSsize_t(args[1])) == -1 || (width = PyLong_AsSsize_t(args[2])) == -1) {
        return NULL;
    }
    Py_ssize_t row_size = per_key * width;
    if ((per_key != 1 && per_key != 3) || width < 0 ||
        (row_size && PyBytes_GET_SIZE(args[0]) % row_size)) {
        PyErr_SetString(PyExc_ValueError, "rows do not fit per_key and width");
        return NULL;
    }
    if (!row_size) {
        return PyList_New(0);
    }
    const unsigned char *rows = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]) / row_size;
    Py_ssize_t words = (width + 7) / 8, bits = 8 * width;
    Py_buffer rank_view;
    if (get_rank(args[3], &rank_view) < 0) {
        return NULL;
    }
    const int64_t *rank = rank_view.buf;
    Py_ssize_t ranked = rank_view.len / 8;
    PyObject *names = args[4], *result = NULL;
    /* alive, held, gpu, cpu, storage, the run's gpu and cpu patterns */
    uint64_t *w = PyMem_Calloc((size_t)words * 7, sizeof(uint64_t));
    int64_t *counts = PyMem_Calloc((size_t)bits * 3, sizeof(int64_t));
    Found *found = PyMem_Malloc(sizeof(Found) * (size_t)bits);
    unsigned char *allowed = PyMem_Calloc((size_t)bits, 1);
    if (w == NULL || counts == NULL || found == NULL || allowed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *alive = w, *held = w + words, *gpu = w + 2 * words, *cpu = w + 3 * words;
    uint64_t *storage = w + 4 * words, *run_gpu = w + 5 * words, *run_cpu = w + 6 * words;
    int64_t *length = counts, *on_gpu = counts + bits, *on_cpu = counts + 2 * bits;
    if (allowed_ids(args[5], allowed, bits) < 0) {
        goto done;
    }
    for (Py_ssize_t m = 0; m < bits; m++) {
        alive[m / 64] |= (uint64_t)allowed[m] << (m % 64);
    }
    int64_t run = 0;
    const unsigned char *previous = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *row = rows + i * row_size;
        if (previous != NULL && memcmp(row, previous, (size_t)row_size) == 0) {
            run++; /* the same holders: nobody drops out, the same tiers count */
            continue;
        }
        if (run) {
            add_bits(alive, words, length, run);
            add_bits(run_gpu, words, on_gpu, run);
            add_bits(run_cpu, words, on_cpu, run);
        }
        load_words(rows, i, per_key, 0, width, gpu, words);
        if (per_key == 3) {
            load_words(rows, i, per_key, 1, width, cpu, words);
            load_words(rows, i, per_key, 2, width, storage, words);
        }
        uint64_t any = 0;
        for (Py_ssize_t k = 0; k < words; k++) {
            held[k] = per_key == 3 ? gpu[k] | cpu[k] | storage[k] : gpu[k];
            alive[k] &= held[k];
            any |= alive[k];
            run_gpu[k] = per_key == 3 ? alive[k] & gpu[k] : 0;
            run_cpu[k] = per_key == 3 ? alive[k] & cpu[k] & ~gpu[k] : 0;
        }
        run = any ? 1 : 0;
        previous = row;
        if (!any) {
            break;
        }
    }
    if (run) {
        add_bits(alive, words, length, run);
        add_bits(run_gpu, words, on_gpu, run);
        add_bits(run_cpu, words, on_cpu, run);
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t m = 0; m < bits && m < ranked; m++) {
        if (length[m] > 0 && rank[m] >= 0) {
            int64_t g = per_key == 3 ? on_gpu[m] : length[m];
            found[count++] = (Found){length[m], g, rank[m], m};
        }
    }
    qsort(found, (size_t)count, sizeof(Found), best_first);
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        Found *hit = &found[i];
        if (hit->member >= PyList_GET_SIZE(names) ||
            !PyUnicode_Check(PyList_GET_ITEM(names, hit->member))) {
            PyErr_Format(PyExc_ValueError, "member id %zd has a rank but no name", hit->member);
            Py_CLEAR(result);
            break;
        }
        int64_t c = per_key == 3 ? on_cpu[hit->member] : 0;
        PyObject *tiers = Py_BuildValue("(LLL)", (long long)hit->gpu, (long long)c,
                                        (long long)(hit->length - hit->gpu - c));
        PyObject *blocks = tiers ? PyLong_FromLongLong(hit->length) : NULL;
        PyObject *call[3] = {PyList_GET_ITEM(names, hit->member), blocks, tiers};
        PyObject *match = blocks ? PyObject_Vectorcall(args[6], call, 3, NULL) : NULL;
        Py_XDECREF(tiers);
        Py_XDECREF(blocks);
        if (match == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, match);
    }
done:
    PyMem_Free(w);
    PyMem_Free(counts);
    PyMem_Free(found);
    PyMem_Free(allowed);
    PyBuffer_Release(&rank_view);
    return result;
}

#endif
