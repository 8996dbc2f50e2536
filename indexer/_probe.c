/* Compiled probing kernels for the memory backend's hash table (indexer/table_probe.py).
 *
 * Why C: the table is open addressing with linear probing over numpy arrays. In numpy a
 * probe is several vectorised passes (gather the home slots, then windows for the keys
 * not at home, then scatter-and-read-back to settle keys of one batch racing for a
 * slot); each pass costs a call and a temporary array. Written as one loop per key it
 * is a handful of cache misses, and a fresh-key insert or a growth rebuild costs a few
 * nanoseconds per key instead of a few hundred.
 *
 * The functions take buffers (numpy arrays, through the buffer protocol, so no numpy
 * headers are needed to build) and follow exactly the table's rules, which
 * indexer/table_probe.py documents and whose pure-numpy path stays the reference:
 *   home(key) = ((key ^ seed) * 0x9E3779B97F4A7C15) >> shift
 *   a key lies within max_disp slots after its home, with no empty slot (0) between;
 *   probing never wraps; key 0 lives in a reserved slot the caller names.
 * They return -1 where the numpy path raises TableFull, and never raise otherwise
 * except on wrong argument types or sizes (TypeError/ValueError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MULT 0x9E3779B97F4A7C15ULL

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* Get a C-contiguous buffer of items of `itemsize` bytes; writable if asked. */
static int get(PyObject *obj, Buf *b, Py_ssize_t itemsize, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        return -1;
    }
    b->held = 1;
    if (b->view.itemsize != itemsize || b->view.len % itemsize != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected items of %zd bytes, got %zd", name,
                     itemsize, b->view.itemsize);
        release(b);
        return -1;
    }
    return 0;
}

static inline Py_ssize_t home_of(uint64_t key, uint64_t seed, unsigned shift) {
    return (Py_ssize_t)(((key ^ seed) * MULT) >> shift);
}

/* find(table, keys, seed, shift, max_disp, limit, zero_slot, slots, cursors_or_None)
 *
 * slots[i] = slot holding keys[i], or -1; key 0 is answered with zero_slot (-1 when it
 * is not stored). With cursors, cursors[i] = where an absent key's insert starts: its
 * first empty slot, searched up to `limit` slots from home past max_disp. Returns 0,
 * or -1 when an absent key has no empty slot within `limit` (the caller raises
 * TableFull). */
static PyObject *probe_find(PyObject *self, PyObject *args) {
    PyObject *table_o, *keys_o, *slots_o, *cursors_o;
    unsigned long long seed;
    unsigned int shift;
    Py_ssize_t max_disp, limit, zero_slot;
    if (!PyArg_ParseTuple(args, "OOKInnnOO", &table_o, &keys_o, &seed, &shift, &max_disp,
                          &limit, &zero_slot, &slots_o, &cursors_o)) {
        return NULL;
    }
    Buf table = {0}, keys = {0}, slots = {0}, cursors = {0};
    int want_cursors = cursors_o != Py_None;
    PyObject *result = NULL;
    if (get(table_o, &table, 8, 0, "table") < 0 || get(keys_o, &keys, 8, 0, "keys") < 0 ||
        get(slots_o, &slots, sizeof(Py_ssize_t), 1, "slots") < 0 ||
        (want_cursors && get(cursors_o, &cursors, sizeof(Py_ssize_t), 1, "cursors") < 0)) {
        goto done;
    }
    Py_ssize_t n = keys.view.len / 8, size = table.view.len / 8;
    if (slots.view.len / (Py_ssize_t)sizeof(Py_ssize_t) != n ||
        (want_cursors && cursors.view.len / (Py_ssize_t)sizeof(Py_ssize_t) != n)) {
        PyErr_SetString(PyExc_ValueError, "slots and cursors must be as long as keys");
        goto done;
    }
    const uint64_t *t = table.view.buf, *k = keys.view.buf;
    Py_ssize_t *out = slots.view.buf, *cur = want_cursors ? cursors.view.buf : NULL;
    Py_ssize_t reach = want_cursors ? limit : max_disp;
    int status = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = k[i];
        if (key == 0) { /* every empty slot "holds" 0: key 0 has its reserved slot */
            out[i] = zero_slot;
            if (cur != NULL) {
                cur[i] = -1;
            }
            continue;
        }
        Py_ssize_t s = home_of(key, seed, shift), found = -1, gap = -1;
        for (Py_ssize_t d = 0; d <= reach && s + d < size; d++) {
            uint64_t at = t[s + d];
            if (at == key) {
                found = s + d;
                break;
            }
            if (at == 0) {
                gap = s + d;
                break;
            }
        }
        out[i] = found;
        if (cur != NULL && found < 0) {
            cur[i] = gap;
            if (gap < 0) {
                status = -1;
            }
        }
    }
    result = PyLong_FromLong(status);
done:
    release(&table);
    release(&keys);
    release(&slots);
    release(&cursors);
    return result;
}

/* insert(table, keys, cursors, seed, shift, limit, zero_slot, slots) -> int
 *
 * Place absent keys (repeats allowed: a repeat finds the copy placed before it), each
 * starting at its cursor; slots[i] = its slot (zero_slot for key 0). Returns the largest displacement from
 * home, or -1 when a key would land more than `limit` slots from home (keys placed
 * before then stay, as dead slots the caller's rebuild drops). */
static PyObject *probe_insert(PyObject *self, PyObject *args) {
    PyObject *table_o, *keys_o, *cursors_o, *slots_o;
    unsigned long long seed;
    unsigned int shift;
    Py_ssize_t limit, zero_slot;
    if (!PyArg_ParseTuple(args, "OOOKInnO", &table_o, &keys_o, &cursors_o, &seed, &shift,
                          &limit, &zero_slot, &slots_o)) {
        return NULL;
    }
    Buf table = {0}, keys = {0}, cursors = {0}, slots = {0};
    PyObject *result = NULL;
    if (get(table_o, &table, 8, 1, "table") < 0 || get(keys_o, &keys, 8, 0, "keys") < 0 ||
        get(cursors_o, &cursors, sizeof(Py_ssize_t), 0, "cursors") < 0 ||
        get(slots_o, &slots, sizeof(Py_ssize_t), 1, "slots") < 0) {
        goto done;
    }
    Py_ssize_t n = keys.view.len / 8, size = table.view.len / 8;
    if (cursors.view.len / (Py_ssize_t)sizeof(Py_ssize_t) != n ||
        slots.view.len / (Py_ssize_t)sizeof(Py_ssize_t) != n) {
        PyErr_SetString(PyExc_ValueError, "cursors and slots must be as long as keys");
        goto done;
    }
    uint64_t *t = table.view.buf;
    const uint64_t *k = keys.view.buf;
    const Py_ssize_t *cur = cursors.view.buf;
    Py_ssize_t *out = slots.view.buf, worst = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = k[i];
        if (key == 0) {
            out[i] = zero_slot;
            continue;
        }
        Py_ssize_t home = home_of(key, seed, shift), s = cur[i];
        if (s < home) {
            s = home;
        }
        while (s < size && s - home <= limit && t[s] != 0 && t[s] != key) {
            s++;
        }
        if (s >= size || s - home > limit) {
            worst = -1;
            break;
        }
        t[s] = key;
        out[i] = s;
        if (s - home > worst) {
            worst = s - home;
        }
    }
    result = PyLong_FromSsize_t(worst);
done:
    release(&table);
    release(&keys);
    release(&cursors);
    release(&slots);
    return result;
}

/* layout(table, keys, seed, shift, limit, zero_slot, slots) -> int
 *
 * Lay distinct keys out in `table`, which must be all zeros: slots[i] = the slot of
 * keys[i] (zero_slot for key 0, whose slot holds 0 anyway). Returns the largest displacement, or -1 past `limit` (the caller tries a
 * bigger table). */
static PyObject *probe_layout(PyObject *self, PyObject *args) {
    PyObject *table_o, *keys_o, *slots_o;
    unsigned long long seed;
    unsigned int shift;
    Py_ssize_t limit, zero_slot;
    if (!PyArg_ParseTuple(args, "OOKInnO", &table_o, &keys_o, &seed, &shift, &limit,
                          &zero_slot, &slots_o)) {
        return NULL;
    }
    Buf table = {0}, keys = {0}, slots = {0};
    PyObject *result = NULL;
    if (get(table_o, &table, 8, 1, "table") < 0 || get(keys_o, &keys, 8, 0, "keys") < 0 ||
        get(slots_o, &slots, sizeof(Py_ssize_t), 1, "slots") < 0) {
        goto done;
    }
    Py_ssize_t n = keys.view.len / 8, size = table.view.len / 8;
    if (slots.view.len / (Py_ssize_t)sizeof(Py_ssize_t) != n) {
        PyErr_SetString(PyExc_ValueError, "slots must be as long as keys");
        goto done;
    }
    uint64_t *t = table.view.buf;
    const uint64_t *k = keys.view.buf;
    Py_ssize_t *out = slots.view.buf, worst = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] == 0) {
            out[i] = zero_slot;
            continue;
        }
        Py_ssize_t home = home_of(k[i], seed, shift), s = home;
        while (s < size && s - home <= limit && t[s] != 0) {
            s++;
        }
        if (s >= size || s - home > limit) {
            worst = -1;
            break;
        }
        t[s] = k[i];
        out[i] = s;
        if (s - home > worst) {
            worst = s - home;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(worst);
done:
    release(&table);
    release(&keys);
    release(&slots);
    return result;
}

/* distinct(values) -> bool
 *
 * Whether no value of an int64 buffer repeats: one pass over a scratch hash set, where
 * the numpy path sorts. Values are slot numbers (or slot-member pairs) of one update. */
static PyObject *probe_distinct(PyObject *self, PyObject *arg) {
    Buf values = {0};
    if (get(arg, &values, 8, 0, "values") < 0) {
        return NULL;
    }
    Py_ssize_t n = values.view.len / 8, cap = 16;
    while (cap < 2 * n) {
        cap <<= 1;
    }
    /* open addressing; `used` marks occupied cells, so every value (0 too) can be held */
    uint64_t *cells = PyMem_Calloc((size_t)cap, sizeof(uint64_t));
    unsigned char *used = PyMem_Calloc((size_t)cap, 1);
    if (cells == NULL || used == NULL) {
        PyMem_Free(cells);
        PyMem_Free(used);
        release(&values);
        return PyErr_NoMemory();
    }
    const uint64_t *v = values.view.buf;
    unsigned shift = 64;
    for (Py_ssize_t c = cap; c > 1; c >>= 1) {
        shift--;
    }
    int unique = 1;
    for (Py_ssize_t i = 0; i < n && unique; i++) {
        Py_ssize_t at = (Py_ssize_t)((v[i] * MULT) >> shift);
        while (used[at]) {
            if (cells[at] == v[i]) {
                unique = 0;
                break;
            }
            at = (at + 1) & (cap - 1);
        }
        used[at] = 1;
        cells[at] = v[i];
    }
    PyMem_Free(cells);
    PyMem_Free(used);
    release(&values);
    return PyBool_FromLong(unique);
}

/* move_rows(src, dst, src_rows, dst_rows, row_bytes) -> None
 *
 * dst row dst_rows[i] = src row src_rows[i] (rows of row_bytes bytes): the gather and
 * scatter of a rebuild in one pass, without the temporary array numpy's
 * `dst[b] = src[a]` makes. Every row number is checked against its buffer. */
static PyObject *probe_move_rows(PyObject *self, PyObject *args) {
    PyObject *src_o, *dst_o, *from_o, *to_o;
    Py_ssize_t row;
    if (!PyArg_ParseTuple(args, "OOOOn", &src_o, &dst_o, &from_o, &to_o, &row)) {
        return NULL;
    }
    Buf src = {0}, dst = {0}, from = {0}, to = {0};
    PyObject *result = NULL;
    if (row <= 0) {
        PyErr_SetString(PyExc_ValueError, "row_bytes must be positive");
        return NULL;
    }
    if (PyObject_GetBuffer(src_o, &src.view, PyBUF_C_CONTIGUOUS) < 0) {
        goto done;
    }
    src.held = 1;
    if (PyObject_GetBuffer(dst_o, &dst.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        goto done;
    }
    dst.held = 1;
    if (get(from_o, &from, sizeof(Py_ssize_t), 0, "src_rows") < 0 ||
        get(to_o, &to, sizeof(Py_ssize_t), 0, "dst_rows") < 0) {
        goto done;
    }
    Py_ssize_t n = from.view.len / (Py_ssize_t)sizeof(Py_ssize_t);
    if (to.view.len / (Py_ssize_t)sizeof(Py_ssize_t) != n) {
        PyErr_SetString(PyExc_ValueError, "src_rows and dst_rows must be as long");
        goto done;
    }
    Py_ssize_t src_n = src.view.len / row, dst_n = dst.view.len / row;
    const Py_ssize_t *a = from.view.buf, *b = to.view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (a[i] < 0 || a[i] >= src_n || b[i] < 0 || b[i] >= dst_n) {
            PyErr_SetString(PyExc_IndexError, "row out of range");
            goto done;
        }
    }
    const char *sp = src.view.buf;
    char *dp = dst.view.buf;
    if (row == 8) {
        for (Py_ssize_t i = 0; i < n; i++) {
            ((uint64_t *)dp)[b[i]] = ((const uint64_t *)sp)[a[i]];
        }
    } else if (row == 4) {
        for (Py_ssize_t i = 0; i < n; i++) {
            ((uint32_t *)dp)[b[i]] = ((const uint32_t *)sp)[a[i]];
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(dp + b[i] * row, sp + a[i] * row, (size_t)row);
        }
    }
    result = Py_NewRef(Py_None);
done:
    release(&src);
    release(&dst);
    release(&from);
    release(&to);
    return result;
}

static PyMethodDef methods[] = {
    {"move_rows", probe_move_rows, METH_VARARGS, "dst[dst_rows] = src[src_rows], row by row."},
    {"distinct", probe_distinct, METH_O, "Whether no value of an int64 buffer repeats."},
    {"find", probe_find, METH_VARARGS, "Slots of keys (-1 absent), and insert cursors."},
    {"insert", probe_insert, METH_VARARGS, "Place absent keys; largest displacement or -1."},
    {"layout", probe_layout, METH_VARARGS, "Lay keys out in an empty table; displacement."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_probe", "Compiled probing kernels of the memory table.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
