/* Merging the scans of consecutive batches into one (events/wire/_wire_scan.c's merge).
 *
 * Only _wire_scan.c includes this. The applier delivers a stream's in-order messages of
 * one turn as one batch (events/ingest/in_order.py): their hashes one after another, their
 * runs joined where one continues the one before, their events' spans renumbered.
 * This works on the scans as Python objects (what scan() and drain() hand back), so a
 * merge of merges is the same as one merge. */
#ifndef KVINDEX_WIRE_SCAN_MERGE_H
#define KVINDEX_WIRE_SCAN_MERGE_H

/* Run tuple items that must be equal for two runs to join: the tag and the fields from
 * parent_none on (the others are positions). */
static const int KEY_ITEMS[] = {0, 5, 6, 7, 8, 9, 10, 11};

static int same_key(PyObject *a, PyObject *b) {
    for (size_t i = 0; i < sizeof(KEY_ITEMS) / sizeof(KEY_ITEMS[0]); i++) {
        int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(a, KEY_ITEMS[i]),
                                          PyTuple_GET_ITEM(b, KEY_ITEMS[i]), Py_EQ);
        if (eq <= 0) return eq;
    }
    return 1;
}

static long item_long(PyObject *run, int i) { return PyLong_AsLong(PyTuple_GET_ITEM(run, i)); }

/* A run tuple like `like` with new positions (first, count, start, stop). */
static PyObject *moved_run(PyObject *like, long first, long count, long start, long stop) {
    PyObject *t = PyTuple_New(12);
    if (t == NULL) return NULL;
    long pos[4] = {first, count, start, stop};
    for (int i = 0; i < 12; i++) {
        PyObject *item;
        if (i >= 1 && i <= 4) {
            item = PyLong_FromLong(pos[i - 1]);
            if (item == NULL) {
                Py_DECREF(t);
                return NULL;
            }
        } else {
            item = Py_NewRef(PyTuple_GET_ITEM(like, i));
        }
        PyTuple_SET_ITEM(t, i, item);
    }
    return t;
}

/* merge(hashes, runs, spans, parts) -> (hashes, runs, spans): the scans of
 * consecutive batches as one. Per scan: its hashes (bytes, native uint64s), its runs
 * (tuple of run tuples, as scan() makes them), its spans (bytes, uint32 (part, start,
 * stop) per event) and how many payloads it covers. Hashes and spans are concatenated
 * (part numbers shifted past the scans before); runs get positions in the whole, and a
 * run that continues the one before it (same tag and fields, adjacent) joins it. */
static PyObject *wire_merge(PyObject *self, PyObject *args) {
    PyObject *hash_list, *run_list, *span_list, *part_list;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyList_Type, &hash_list, &PyList_Type, &run_list,
                          &PyList_Type, &span_list, &PyList_Type, &part_list)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(hash_list);
    if (PyList_GET_SIZE(run_list) != n || PyList_GET_SIZE(span_list) != n ||
        PyList_GET_SIZE(part_list) != n) {
        PyErr_SetString(PyExc_ValueError, "merge: as many runs, spans and parts as hashes");
        return NULL;
    }
    Py_ssize_t total = 0, total_spans = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hash_list, i);
        PyObject *r = PyList_GET_ITEM(run_list, i);
        PyObject *sp = PyList_GET_ITEM(span_list, i);
        if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) % 8 || !PyTuple_Check(r) ||
            !PyBytes_Check(sp) || PyBytes_GET_SIZE(sp) % 12 ||
            !PyLong_Check(PyList_GET_ITEM(part_list, i))) {
            PyErr_SetString(PyExc_TypeError, "merge: hashes, runs, spans and part counts");
            return NULL;
        }
        total += PyBytes_GET_SIZE(h);
        total_spans += PyBytes_GET_SIZE(sp);
    }
    PyObject *hashes = PyBytes_FromStringAndSize(NULL, total);
    PyObject *spans = PyBytes_FromStringAndSize(NULL, total_spans);
    PyObject *runs = PyList_New(0);
    if (hashes == NULL || spans == NULL || runs == NULL) goto fail;
    char *out = PyBytes_AS_STRING(hashes);
    uint32_t *span_out = (uint32_t *)PyBytes_AS_STRING(spans);
    long events = 0, hash_base = 0, part_base = 0;
    /* The run being built: the tuple whose fields it has (owned by its scan's tuple) and
     * its positions. */
    PyObject *open = NULL;
    long first = 0, count = 0, start = 0, stop = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hash_list, i);
        PyObject *scan_runs = PyList_GET_ITEM(run_list, i);
        PyObject *sp = PyList_GET_ITEM(span_list, i);
        long parts = PyLong_AsLong(PyList_GET_ITEM(part_list, i));
        if (parts < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "merge: part count < 0");
            goto fail;
        }
        memcpy(out + 8 * hash_base, PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h));
        const uint32_t *span_in = (const uint32_t *)PyBytes_AS_STRING(sp);
        Py_ssize_t n_spans = PyBytes_GET_SIZE(sp) / 4;
        for (Py_ssize_t k = 0; k < n_spans; k += 3) {
            span_out[k] = span_in[k] + (uint32_t)part_base;
            span_out[k + 1] = span_in[k + 1];
            span_out[k + 2] = span_in[k + 2];
        }
        span_out += n_spans;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(scan_runs); j++) {
            PyObject *run = PyTuple_GET_ITEM(scan_runs, j);
            if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 12) {
                PyErr_SetString(PyExc_TypeError, "merge: runs are 12-tuples");
                goto fail;
            }
            long r_first = item_long(run, 1) + events, r_count = item_long(run, 2);
            long r_start = item_long(run, 3) + hash_base, r_stop = item_long(run, 4) + hash_base;
            if (PyErr_Occurred()) goto fail;
            if (open != NULL && first + count == r_first && stop == r_start) {
                int eq = same_key(open, run);
                if (eq < 0) goto fail;
                if (eq) {
                    count += r_count, stop = r_stop;
                    continue;
                }
            }
            if (open != NULL) {
                PyObject *done = moved_run(open, first, count, start, stop);
                if (done == NULL || PyList_Append(runs, done) < 0) {
                    Py_XDECREF(done);
                    goto fail;
                }
                Py_DECREF(done);
            }
            open = run, first = r_first, count = r_count, start = r_start, stop = r_stop;
        }
        events += (long)(n_spans / 3);
        hash_base += PyBytes_GET_SIZE(h) / 8;
        part_base += parts;
    }
    if (open != NULL) {
        PyObject *done = moved_run(open, first, count, start, stop);
        if (done == NULL || PyList_Append(runs, done) < 0) {
            Py_XDECREF(done);
            goto fail;
        }
        Py_DECREF(done);
    }
    PyObject *run_tuple = PyList_AsTuple(runs);
    Py_DECREF(runs);
    if (run_tuple == NULL) {
        Py_DECREF(hashes);
        Py_DECREF(spans);
        return NULL;
    }
    return Py_BuildValue("(NNN)", hashes, run_tuple, spans);
fail:
    Py_XDECREF(hashes);
    Py_XDECREF(spans);
    Py_XDECREF(runs);
    return NULL;
}

#endif /* KVINDEX_WIRE_SCAN_MERGE_H */
