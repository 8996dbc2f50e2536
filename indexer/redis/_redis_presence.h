/* Which positions each member holds, per tier: the backend's ``presence`` over the
 * matrix of _redis_rows.h (indexer/redis/_redis_lookup.c's third part; one translation unit).
 *
 * Hybrid models (sliding-window or Mamba KV groups) score with one presence query per
 * KV group, so a /score of such a model costs this two or three times. The numpy path
 * (redis_walk.held_positions) unpacks the whole matrix, transposes it and packs it
 * again per tier; here each set bit of the matrix is
 * moved once into its member's mask, and only members holding something get ints.
 */
#ifndef KVINDEX_REDIS_PRESENCE_H
#define KVINDEX_REDIS_PRESENCE_H

/* ``size`` little-endian bytes as a non-negative int. */
static PyObject *int_from_le(const unsigned char *bytes, Py_ssize_t size) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(
        bytes, (size_t)size, Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
#else
    return _PyLong_FromByteArray(bytes, (size_t)size, 1, 0);
#endif
}

PyDoc_STRVAR(held_positions_doc,
"held_positions(rows, per_key, width, rank, names, allowed, presence) -> list\n\n"
"Per member holding any of the matrix's keys, presence(name, (gpu, cpu, storage)): a\n"
"bitmask per tier over key positions (bit i: it holds key i there), sorted by name\n"
"(``rank``, int64 per member id: its place in name order, -1 for an id without a\n"
"name, which is left out). ``allowed``: member ids to answer for, or None.");

static PyObject *held_positions(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t per_key, width;
    if (nargs != 7 || !PyBytes_Check(args[0]) || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "held_positions(rows: bytes, per_key, width, rank, names: list, "
                        "allowed, presence)");
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
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]) / row_size, bits = 8 * width;
    Py_ssize_t mask_size = (n + 7) / 8;
    Py_buffer rank_view;
    if (get_rank(args[3], &rank_view) < 0) {
        return NULL;
    }
    const int64_t *rank = rank_view.buf;
    Py_ssize_t ranked = rank_view.len / 8;
    PyObject *names = args[4], *result = NULL, *zero = NULL;
    unsigned char *allowed = PyMem_Calloc((size_t)bits, 1);
    /* masks[(member * 3 + tier) * mask_size ...]: the member's positions in that tier */
    unsigned char *masks = PyMem_Calloc((size_t)(bits * 3), (size_t)mask_size);
    Found *found = PyMem_Malloc(sizeof(Found) * (size_t)bits);
    if (allowed == NULL || masks == NULL || found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (allowed_ids(args[5], allowed, bits) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *row = rows + i * row_size;
        for (Py_ssize_t t = 0; t < per_key; t++) {
            const unsigned char *slot = row + t * width;
            for (Py_ssize_t b = 0; b < width; b++) {
                unsigned x = slot[b];
                while (x) {
                    Py_ssize_t m = 8 * b + __builtin_ctz(x);
                    x &= x - 1;
                    masks[(m * 3 + t) * mask_size + i / 8] |= (unsigned char)(1u << (i % 8));
                }
            }
        }
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t m = 0; m < bits && m < ranked; m++) {
        if (!allowed[m] || rank[m] < 0) {
            continue;
        }
        const unsigned char *mine = masks + m * 3 * mask_size;
        for (Py_ssize_t k = 0; k < 3 * mask_size; k++) {
            if (mine[k]) {
                found[count++] = (Found){0, 0, rank[m], m};
                break;
            }
        }
    }
    qsort(found, (size_t)count, sizeof(Found), best_first); /* equal lengths: by rank */
    zero = PyLong_FromLong(0);
    result = zero ? PyList_New(count) : NULL;
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        Py_ssize_t m = found[i].member;
        if (m >= PyList_GET_SIZE(names) || !PyUnicode_Check(PyList_GET_ITEM(names, m))) {
            PyErr_Format(PyExc_ValueError, "member id %zd has a rank but no name", m);
            Py_CLEAR(result);
            break;
        }
        PyObject *tiers = PyTuple_New(3);
        for (Py_ssize_t t = 0; tiers != NULL && t < 3; t++) {
            PyObject *mask = t < per_key ? int_from_le(masks + (m * 3 + t) * mask_size, mask_size)
                                         : Py_NewRef(zero);
            if (mask == NULL) {
                Py_CLEAR(tiers);
                break;
            }
            PyTuple_SET_ITEM(tiers, t, mask);
        }
        PyObject *call[2] = {PyList_GET_ITEM(names, m), tiers};
        PyObject *presence = tiers ? PyObject_Vectorcall(args[6], call, 2, NULL) : NULL;
        Py_XDECREF(tiers);
        if (presence == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, presence);
    }
done:
    Py_XDECREF(zero);
    PyMem_Free(allowed);
    PyMem_Free(masks);
    PyMem_Free(found);
    PyBuffer_Release(&rank_view);
    return result;
}

#endif
