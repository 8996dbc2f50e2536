/* Compiled probing kernels for the memory backend's hash table (BlockTable,
 * indexer/memory/table.py).
 *
 * Why C: the table is open addressing with linear probing over numpy arrays. In numpy a
 * probe is several vectorised passes (gather the home slots, then windows for the keys
 * not at home, then scatter-and-read-back to settle keys of one batch racing for a
 * slot); each pass costs a call and a temporary array. Written as one loop per key it
 * is a handful of cache misses (bench/README.md has the figures).
 *
 * The functions take buffers (numpy arrays, through the buffer protocol, so no numpy
 * headers are needed to build) and follow exactly the table's rules, which
 * BlockTable's docstring documents and whose pure-numpy path stays the reference:
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

/* ---- The lookup walk: one call answers a prefix lookup (BlockTable.walk) ----
 *
 * walk(table, gpu, cpu, storage, keys, seed, shift, max_disp, zero_slot, allowed, width,
 *      names, make) -> list
 *
 * Each member's longest run of leading `keys` held in any tier, as `make(name, blocks,
 * (gpu, cpu, storage))` objects in the order the numpy path gives (most blocks first;
 * then, GPU-only, by name; with CPU or storage masks, by blocks held off the GPU, then
 * name). Key by key: probe, OR the tier masks of its slot, AND into the running mask,
 * stop at the first key no (allowed) member holds. The running mask only loses bits, so
 * each member's length is where its bit drops: those drops are logged as groups, and the
 * answer is the groups read backwards.
 *
 * `gpu` (and `cpu`/`storage`, or None) are the tier masks, `width` uint64 words per slot;
 * `keys` a uint64 buffer or a list/tuple of ints (TypeError or OverflowError for anything
 * else: the caller converts such keys itself and calls again); `allowed` None (every
 * member) or the member filter as a non-negative int; `zero_slot` -1 when key 0 is not
 * stored; `names[m]` member id m's name (a str for every id with a bit set). */

/* How many keys ahead the walk prefetches a key's home slot. */
#define PREFETCH_AHEAD 8

/* A lookup's keys as uint64s: a buffer's memory, or ints copied out of a list/tuple. */
typedef struct {
    const uint64_t *k;
    Py_ssize_t n;
    uint64_t *owned;
    Buf buf;
} Keys;

static void keys_release(Keys *keys) {
    PyMem_Free(keys->owned);
    keys->owned = NULL;
    release(&keys->buf);
}

/* An int as uint64 (OverflowError outside 0..2**64-1). PyLong_AsUnsignedLong where it
 * is 64 bits: CPython reads its digits in a loop there, where PyLong_AsUnsignedLongLong
 * goes through the generic byte-array conversion (3.11), at twice the cost per key. */
static inline uint64_t as_u64(PyObject *item) {
#if ULONG_MAX == 0xFFFFFFFFFFFFFFFFULL
    return (uint64_t)PyLong_AsUnsignedLong(item);
#else
    return (uint64_t)PyLong_AsUnsignedLongLong(item);
#endif
}

static int keys_get(PyObject *obj, Keys *out) {
    out->owned = NULL;
    out->buf.held = 0;
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        PyObject **items = PySequence_Fast_ITEMS(obj);
        uint64_t *dst = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(uint64_t));
        if (dst == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        out->owned = dst;
        /* exact ints and bool only: reading them runs no Python code, so the list
         * cannot change under the loop */
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = items[i];
            if (!PyLong_Check(item)) {
                PyErr_SetString(PyExc_TypeError, "block keys must be integers");
                keys_release(out);
                return -1;
            }
            uint64_t v = as_u64(item);
            if (v == (uint64_t)-1 && PyErr_Occurred()) {
                keys_release(out);
                return -1;
            }
            dst[i] = v;
        }
        out->k = dst;
        out->n = n;
        return 0;
    }
    if (get(obj, &out->buf, 8, 0, "keys") < 0) {
        return -1;
    }
    out->k = out->buf.view.buf;
    out->n = out->buf.view.len / 8;
    return 0;
}

static inline Py_ssize_t slot_of(const uint64_t *t, Py_ssize_t size, uint64_t key,
                                 uint64_t seed, unsigned shift, Py_ssize_t max_disp,
                                 Py_ssize_t zero_slot) {
    if (key == 0) {
        return zero_slot;
    }
    Py_ssize_t s = home_of(key, seed, shift);
    for (Py_ssize_t d = 0; d <= max_disp && s + d < size; d++) {
        uint64_t at = t[s + d];
        if (at == key) {
            return s + d;
        }
        if (at == 0) {
            return -1;
        }
    }
    return -1;
}

/* The member filter as `width` words; every bit when `allowed` is None. */
static int allowed_words(PyObject *allowed, uint64_t *out, Py_ssize_t width) {
    if (allowed == Py_None) {
        for (Py_ssize_t w = 0; w < width; w++) {
            out[w] = ~0ULL;
        }
        return 0;
    }
    if (!PyLong_Check(allowed)) {
        PyErr_SetString(PyExc_TypeError, "allowed: expected None or an int");
        return -1;
    }
    PyObject *rest = Py_NewRef(allowed), *word_mask = PyLong_FromUnsignedLongLong(~0ULL);
    PyObject *shift = PyLong_FromLong(64);
    int status = (word_mask != NULL && shift != NULL) ? 0 : -1;
    for (Py_ssize_t w = 0; w < width && status == 0; w++) {
        PyObject *low = PyNumber_And(rest, word_mask);
        if (low == NULL) {
            status = -1;
            break;
        }
        out[w] = PyLong_AsUnsignedLongLong(low);
        Py_DECREF(low);
        if (out[w] == (unsigned long long)-1 && PyErr_Occurred()) {
            status = -1;
            break;
        }
        PyObject *next = PyNumber_Rshift(rest, shift);
        Py_DECREF(rest);
        rest = next;
        if (rest == NULL) {
            status = -1;
        }
    }
    Py_XDECREF(rest);
    Py_XDECREF(word_mask);
    Py_XDECREF(shift);
    return status;
}

/* Ordering of one group of equal length: off-GPU blocks (when counted), then name. */
typedef struct {
    PyObject **names;
    const int32_t *off;
} Order;

static inline int before(const Order *o, int32_t a, int32_t b) {
    if (o->off != NULL && o->off[a] != o->off[b]) {
        return o->off[a] < o->off[b];
    }
    return PyUnicode_Compare(o->names[a], o->names[b]) < 0;
}

/* Sort ids[0..n) by `before` (names are distinct, so any stable or unstable sort gives
 * the one order); `tmp` has room for n ids. Insertion sort for short runs, else merge. */
static void sort_ids(const Order *o, int32_t *ids, int32_t *tmp, Py_ssize_t n) {
    if (n <= 16) {
        for (Py_ssize_t i = 1; i < n; i++) {
            int32_t id = ids[i];
            Py_ssize_t j = i;
            while (j > 0 && before(o, id, ids[j - 1])) {
                ids[j] = ids[j - 1];
                j--;
            }
            ids[j] = id;
        }
        return;
    }
    Py_ssize_t half = n / 2;
    sort_ids(o, ids, tmp, half);
    sort_ids(o, ids + half, tmp, n - half);
    Py_ssize_t a = 0, b = half, k = 0;
    while (a < half && b < n) {
        tmp[k++] = before(o, ids[b], ids[a]) ? ids[b++] : ids[a++];
    }
    while (a < half) {
        tmp[k++] = ids[a++];
    }
    while (b < n) {
        tmp[k++] = ids[b++];
    }
    memcpy(ids, tmp, (size_t)n * sizeof(int32_t));
}

/* Append the ids of the set bits of `bits` (width words) to ids[*count...]. */
static inline void push_bits(const uint64_t *bits, Py_ssize_t width, int32_t *ids,
                             Py_ssize_t *count) {
    for (Py_ssize_t w = 0; w < width; w++) {
        uint64_t x = bits[w];
        while (x) {
            ids[(*count)++] = (int32_t)(64 * w + __builtin_ctzll(x));
            x &= x - 1;
        }
    }
}

static inline Py_ssize_t popcount_words(const uint64_t *bits, Py_ssize_t width) {
    Py_ssize_t n = 0;
    for (Py_ssize_t w = 0; w < width; w++) {
        n += __builtin_popcountll(bits[w]);
    }
    return n;
}

/* (a, b, c) as a tuple of ints (Py_BuildValue parses its format on every call). */
static PyObject *triple(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c) {
    PyObject *out = PyTuple_New(3);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t v[3] = {a, b, c};
    for (int i = 0; i < 3; i++) {
        PyObject *item = PyLong_FromSsize_t(v[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

/* (n, 0, 0), the tiers of a GPU-only match: one shared tuple per n below the bound, made
 * on first use. Each new tuple is tracked by the garbage collector, and dozens of them
 * per lookup would trigger young-generation collections, which set the p99. */
#define SHARED_TIERS 16384
static PyObject *gpu_only_tiers[SHARED_TIERS];

static PyObject *gpu_only(Py_ssize_t n) {
    if (n < 0 || n >= SHARED_TIERS) {
        return triple(n, 0, 0);
    }
    if (gpu_only_tiers[n] == NULL) {
        gpu_only_tiers[n] = triple(n, 0, 0);
        if (gpu_only_tiers[n] == NULL) {
            return NULL;
        }
    }
    return Py_NewRef(gpu_only_tiers[n]);
}

/* One object of the answer: make(name, blocks, tiers). */
static inline PyObject *make_row(PyObject *make, PyObject *name, PyObject *blocks,
                                 PyObject *tiers) {
    PyObject *args[3] = {name, blocks, tiers};
    return PyObject_Vectorcall(make, args, 3, NULL);
}

static PyObject *probe_walk(PyObject *self, PyObject *args) {
    PyObject *table_o, *gpu_o, *cpu_o, *storage_o, *keys_o, *allowed_o, *names, *make;
    unsigned long long seed;
    unsigned int shift;
    Py_ssize_t max_disp, zero_slot, width;
    if (!PyArg_ParseTuple(args, "OOOOOKInnOnO!O", &table_o, &gpu_o, &cpu_o, &storage_o,
                          &keys_o, &seed, &shift, &max_disp, &zero_slot, &allowed_o, &width,
                          &PyList_Type, &names, &make)) {
        return NULL;
    }
    if (width < 1) {
        PyErr_SetString(PyExc_ValueError, "width must be positive");
        return NULL;
    }
    Buf table = {0}, gpu = {0}, cpu = {0}, storage = {0};
    Keys keys = {0};
    uint64_t *words = NULL; /* run, cur, scratch and the row's GPU and CPU words */
    int32_t *ids = NULL, *tmp = NULL, *off = NULL, *on_cpu = NULL;
    Py_ssize_t *group_len = NULL, *group_start = NULL;
    PyObject *result = NULL;
    int has_cpu = cpu_o != Py_None, has_storage = storage_o != Py_None;
    if (get(table_o, &table, 8, 0, "table") < 0 || get(gpu_o, &gpu, 8, 0, "gpu") < 0 ||
        (has_cpu && get(cpu_o, &cpu, 8, 0, "cpu") < 0) ||
        (has_storage && get(storage_o, &storage, 8, 0, "storage") < 0) ||
        keys_get(keys_o, &keys) < 0) {
        goto done;
    }
    Py_ssize_t size = table.view.len / 8, row_words = size * width;
    if (gpu.view.len / 8 != row_words || (has_cpu && cpu.view.len / 8 != row_words) ||
        (has_storage && storage.view.len / 8 != row_words)) {
        PyErr_SetString(PyExc_ValueError, "masks must have width words per table slot");
        goto done;
    }
    words = PyMem_Malloc((size_t)(5 * width) * sizeof(uint64_t));
    if (words == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *run = words, *cur = words + width, *scratch = words + 2 * width;
    uint64_t *seen_gpu = words + 3 * width, *seen_cpu = words + 4 * width;
    if (allowed_words(allowed_o, run, width) < 0) {
        goto done;
    }
    const uint64_t *t = table.view.buf, *g = gpu.view.buf;
    const uint64_t *c = has_cpu ? cpu.view.buf : NULL;
    const uint64_t *st = has_storage ? storage.view.buf : NULL;
    int tiered = has_cpu || has_storage;
    const uint64_t *k = keys.k;
    Py_ssize_t n = keys.n, length = 0, groups = 0, dropped = 0, members = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
#if defined(__GNUC__)
        /* The chain's slots are scattered over a table of megabytes: start loading the
         * home slot (key and GPU mask row) of a key a few ahead, so the cache misses of
         * consecutive keys overlap instead of queueing (a lookup right after ingest
         * traffic finds few of them in cache). */
        if (i + PREFETCH_AHEAD < n) {
            Py_ssize_t ahead = home_of(k[i + PREFETCH_AHEAD], seed, shift);
            if (ahead < size) {
                __builtin_prefetch(t + ahead, 0, 3);
                __builtin_prefetch(g + ahead * width, 0, 3);
            }
        }
#endif
        Py_ssize_t s = slot_of(t, size, k[i], seed, shift, max_disp, zero_slot);
        if (s < 0 || s >= size) {
            break;
        }
        uint64_t any = 0, changed = 0;
        /* each mask word is read once: a writer may change it meanwhile (see
         * MemoryBackend: lookups do not wait for a step), and one read is one state */
        for (Py_ssize_t w = 0; w < width; w++) {
            uint64_t on_gpu = g[s * width + w], held = on_gpu;
            uint64_t in_cpu = c != NULL ? c[s * width + w] : 0;
            held |= in_cpu;
            if (st != NULL) {
                held |= st[s * width + w];
            }
            seen_gpu[w] = on_gpu;
            seen_cpu[w] = in_cpu;
            cur[w] = run[w] & held;
            any |= cur[w];
            changed |= cur[w] ^ run[w];
        }
        if (i == 0) {
            if (!any) {
                break;
            }
            /* every later drop is one of these members */
            members = popcount_words(cur, width);
            ids = PyMem_Malloc((size_t)members * sizeof(int32_t));
            tmp = PyMem_Malloc((size_t)members * sizeof(int32_t));
            group_len = PyMem_Malloc((size_t)(members + 1) * sizeof(Py_ssize_t));
            group_start = PyMem_Malloc((size_t)(members + 1) * sizeof(Py_ssize_t));
            if (tiered) {
                off = PyMem_Calloc((size_t)(64 * width), sizeof(int32_t));
                on_cpu = PyMem_Calloc((size_t)(64 * width), sizeof(int32_t));
            }
            if (ids == NULL || tmp == NULL || group_len == NULL || group_start == NULL ||
                (tiered && (off == NULL || on_cpu == NULL))) {
                PyErr_NoMemory();
                goto done;
            }
        } else if (changed) { /* the members whose prefix is exactly i blocks */
            for (Py_ssize_t w = 0; w < width; w++) {
                scratch[w] = run[w] & ~cur[w];
            }
            group_start[groups] = dropped;
            group_len[groups++] = i;
            push_bits(scratch, width, ids, &dropped);
            if (!any) {
                memset(run, 0, (size_t)width * sizeof(uint64_t));
                break;
            }
        }
        for (Py_ssize_t w = 0; w < width; w++) {
            run[w] = cur[w];
        }
        length = i + 1;
        if (tiered) { /* prefix blocks held only off the GPU, and of them in CPU memory */
            for (Py_ssize_t w = 0; w < width; w++) {
                uint64_t x = run[w] & ~seen_gpu[w], in_cpu = seen_cpu[w];
                while (x) {
                    int b = __builtin_ctzll(x);
                    off[64 * w + b]++;
                    on_cpu[64 * w + b] += (int32_t)((in_cpu >> b) & 1);
                    x &= x - 1;
                }
            }
        }
    }
    if (length > 0 && popcount_words(run, width) > 0) { /* the whole walk: `length` blocks */
        group_start[groups] = dropped;
        group_len[groups++] = length;
        push_bits(run, width, ids, &dropped);
    }
    result = PyList_New(dropped);
    if (result == NULL) {
        goto done;
    }
    Py_ssize_t names_n = PyList_GET_SIZE(names);
    PyObject **name_items = ((PyListObject *)names)->ob_item;
    for (Py_ssize_t j = 0; j < dropped; j++) {
        if (ids[j] >= names_n || !PyUnicode_Check(name_items[ids[j]])) {
            PyErr_SetString(PyExc_ValueError, "a member id with bits set has no name");
            Py_CLEAR(result);
            goto done;
        }
    }
    Order order = {name_items, off};
    Py_ssize_t at = 0;
    for (Py_ssize_t gi = groups - 1; gi >= 0; gi--) {
        Py_ssize_t start = group_start[gi];
        Py_ssize_t end = gi + 1 < groups ? group_start[gi + 1] : dropped;
        Py_ssize_t blocks = group_len[gi];
        if (end - start > 1 || tiered) {
            sort_ids(&order, ids + start, tmp, end - start);
        }
        /* one length object per group, and GPU-only one tiers tuple (immutable) */
        PyObject *length_o = PyLong_FromSsize_t(blocks);
        PyObject *shared = length_o == NULL || tiered ? NULL : gpu_only(blocks);
        if (length_o == NULL || (!tiered && shared == NULL)) {
            Py_XDECREF(length_o);
            Py_CLEAR(result);
            goto done;
        }
        for (Py_ssize_t j = start; j < end; j++) {
            int32_t m = ids[j];
            PyObject *tiers = tiered ? triple(blocks - off[m], on_cpu[m], off[m] - on_cpu[m])
                                     : Py_NewRef(shared);
            PyObject *row = tiers == NULL ? NULL : make_row(make, name_items[m], length_o, tiers);
            Py_XDECREF(tiers);
            if (row == NULL) {
                Py_DECREF(length_o);
                Py_XDECREF(shared);
                Py_CLEAR(result);
                goto done;
            }
            PyList_SET_ITEM(result, at++, row);
        }
        Py_DECREF(length_o);
        Py_XDECREF(shared);
    }
done:
    release(&table);
    release(&gpu);
    release(&cpu);
    release(&storage);
    keys_release(&keys);
    PyMem_Free(words);
    PyMem_Free(ids);
    PyMem_Free(tmp);
    PyMem_Free(off);
    PyMem_Free(on_cpu);
    PyMem_Free(group_len);
    PyMem_Free(group_start);
    return result;
}

/* store(table, keys, seed, shift, limit, zero_slot, zero_used, masks, others, stamps,
 *       tick, width, word, bit, slots, had, gained) -> (worst, created, newly, n_gained,
 *       n_live_new) or None
 *
 * One member stores one copy of each key in one tier (BlockTable.update's common
 * case), in one pass per key instead of numpy's passes over the batch:
 *   1. find each key, or insert it at the first empty slot from its home (a repeat finds
 *      the copy placed before it): slots[i]; worst = the largest displacement of a key
 *      placed, created = keys placed (key 0 takes zero_slot, placed when !zero_used).
 *      None when a key would land more than `limit` slots from home (nothing else was
 *      written: the caller rebuilds, and the keys placed are dead slots it drops).
 *   2. set the member's bit (word `word`, mask `bit`) in `masks` (the tier's, flat,
 *      `width` words per slot): newly = bits set; had[i] = 1 where it was set already
 *      (an extra copy, for the caller's copy counts); n_live_new = slots that held
 *      nothing in any tier (`others`: the other tiers' flat masks) before; gained[:n] =
 *      slots the member now holds in no other tier (for its reverse record); stamps
 *      (or None) get `tick` for every key. */
static PyObject *probe_store(PyObject *self, PyObject *args) {
    PyObject *table_o, *keys_o, *masks_o, *others_o, *stamps_o, *slots_o, *had_o, *gained_o;
    unsigned long long seed, bit;
    unsigned int shift;
    Py_ssize_t limit, zero_slot, width, word;
    int zero_used;
    unsigned long tick;
    if (!PyArg_ParseTuple(args, "OOKInnpOOOknnKOOO", &table_o, &keys_o, &seed, &shift, &limit,
                          &zero_slot, &zero_used, &masks_o, &others_o, &stamps_o, &tick,
                          &width, &word, &bit, &slots_o, &had_o, &gained_o)) {
        return NULL;
    }
    if (!PyTuple_Check(others_o) || PyTuple_GET_SIZE(others_o) > 2 || width < 1 ||
        word < 0 || word >= width) {
        PyErr_SetString(PyExc_ValueError, "store: others is a tuple of at most two masks");
        return NULL;
    }
    Buf table = {0}, keys = {0}, masks = {0}, stamps = {0}, slots = {0}, had = {0};
    Buf gained = {0}, other[2];
    memset(other, 0, sizeof(other));
    Py_ssize_t n_other = PyTuple_GET_SIZE(others_o);
    PyObject *result = NULL;
    if (get(table_o, &table, 8, 1, "table") < 0 || get(keys_o, &keys, 8, 0, "keys") < 0 ||
        get(masks_o, &masks, 8, 1, "masks") < 0 ||
        (stamps_o != Py_None && get(stamps_o, &stamps, 4, 1, "stamps") < 0) ||
        get(slots_o, &slots, sizeof(Py_ssize_t), 1, "slots") < 0 ||
        get(had_o, &had, 1, 1, "had") < 0 || get(gained_o, &gained, 4, 1, "gained") < 0) {
        goto done;
    }
    for (Py_ssize_t t = 0; t < n_other; t++) {
        if (get(PyTuple_GET_ITEM(others_o, t), &other[t], 8, 0, "others") < 0) goto done;
    }
    Py_ssize_t n = keys.view.len / 8, size = table.view.len / 8;
    Py_ssize_t rows = masks.view.len / 8 / width;
    if (slots.view.len / (Py_ssize_t)sizeof(Py_ssize_t) != n || had.view.len != n ||
        gained.view.len / 4 != n || rows != size ||
        (stamps.held && stamps.view.len / 4 != size)) {
        PyErr_SetString(PyExc_ValueError, "store: arrays of the wrong size");
        goto done;
    }
    for (Py_ssize_t t = 0; t < n_other; t++) {
        if (other[t].view.len / 8 != size * width) {
            PyErr_SetString(PyExc_ValueError, "store: other masks of the wrong size");
            goto done;
        }
    }
    uint64_t *tk = table.view.buf, *m = masks.view.buf;
    const uint64_t *k = keys.view.buf;
    Py_ssize_t *out = slots.view.buf;
    unsigned char *was = had.view.buf;
    uint32_t *gain = gained.view.buf, *stamp = stamps.held ? stamps.view.buf : NULL;
    Py_ssize_t worst = 0, created = 0, newly = 0, n_gained = 0, live_new = 0;
    int full = 0;
    enum { AHEAD = 8 };
    /* Without the GIL: lookups may read the table meanwhile, which a step allows (keys
     * fill empty slots, bits are set, word by word: see MemoryBackend's docstring). */
    Py_BEGIN_ALLOW_THREADS
    /* 1. slots */
    for (Py_ssize_t i = 0; i < n && !full; i++) {
        if (i + AHEAD < n && k[i + AHEAD] != 0) {
            __builtin_prefetch(&tk[home_of(k[i + AHEAD], seed, shift)], 1);
        }
        uint64_t key = k[i];
        if (key == 0) {
            out[i] = zero_slot;
            if (!zero_used) {
                zero_used = 1;
                created++;
            }
            continue;
        }
        Py_ssize_t home = home_of(key, seed, shift), s = home;
        for (;;) {
            if (s >= size || s - home > limit) {
                full = 1; /* TableFull */
                break;
            }
            uint64_t at = tk[s];
            if (at == key) break;
            if (at == 0) {
                tk[s] = key;
                created++;
                if (s - home > worst) worst = s - home;
                break;
            }
            s++;
        }
        out[i] = s;
    }
    /* 2. bits, counters, stamps */
    for (Py_ssize_t i = 0; i < n && !full; i++) {
        if (i + AHEAD < n) {
            __builtin_prefetch(&m[out[i + AHEAD] * width + word], 1);
        }
        Py_ssize_t s = out[i], cell = s * width + word;
        if (stamp != NULL) stamp[s] = (uint32_t)tick;
        uint64_t old = m[cell];
        if (old & bit) {
            was[i] = 1;
            continue;
        }
        was[i] = 0;
        m[cell] = old | bit;
        newly++;
        int live = 0, elsewhere = 0;
        for (Py_ssize_t w = 0; w < width && !live; w++) {
            live = m[s * width + w] != (w == word ? bit : 0);
        }
        for (Py_ssize_t t = 0; t < n_other; t++) {
            const uint64_t *o = other[t].view.buf;
            if (o[cell] & bit) elsewhere = 1;
            for (Py_ssize_t w = 0; w < width && !live; w++) {
                live = o[s * width + w] != 0;
            }
        }
        if (!live) live_new++;
        if (!elsewhere) gain[n_gained++] = (uint32_t)s;
    }
    Py_END_ALLOW_THREADS
    if (full) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = Py_BuildValue("(nnnnn)", worst, created, newly, n_gained, live_new);
done:
    release(&table);
    release(&keys);
    release(&masks);
    release(&stamps);
    release(&slots);
    release(&had);
    release(&gained);
    release(&other[0]);
    release(&other[1]);
    return result;
}

/* One member's slots, as a relayout finds them. */
typedef struct {
    uint32_t *slots;
    Py_ssize_t n, cap;
} SlotList;

static int slot_push(SlotList *l, uint32_t slot) {
    if (l->n == l->cap) {
        Py_ssize_t cap = l->cap ? 2 * l->cap : 64;
        uint32_t *grown = PyMem_RawRealloc(l->slots, (size_t)cap * sizeof(uint32_t));
        if (grown == NULL) return -1;
        l->slots = grown, l->cap = cap;
    }
    l->slots[l->n++] = slot;
    return 0;
}

/* relayout(old_keys, old_masks, new_keys, new_masks, width, old_stamps, new_stamps,
 *          seed, shift, limit, old_zero_slot, new_zero_slot)
 *     -> (live, worst, zero_used, [(member, slots bytes), ...]) or None
 *
 * A rebuild in one pass over the old table (indexer/memory/table.py plan_rebuild):
 * every live slot (a bit in any tier's masks: old_masks is a tuple of the allocated
 * tiers' flat masks, `width` words a slot, new_masks the same tiers in the new table)
 * has its key placed in new_keys (all zeros) at the first empty slot from its home
 * there (key 0, in old_zero_slot, goes to new_zero_slot), and its mask rows and stamp
 * moved along. Also each member's slots in the new table (its reverse record, rebuilt
 * exact). None when a key would land more than `limit` slots from home: the caller
 * tries a bigger table. No temporary arrays: the numpy path gathers the live keys,
 * fills a slot map and remaps every record through it. */
static PyObject *probe_relayout(PyObject *self, PyObject *args) {
    PyObject *old_keys_o, *old_masks_o, *new_keys_o, *new_masks_o, *old_stamps_o, *new_stamps_o;
    unsigned long long seed;
    unsigned int shift;
    Py_ssize_t width, limit, old_zero, new_zero;
    if (!PyArg_ParseTuple(args, "OOOOnOOKInnn", &old_keys_o, &old_masks_o, &new_keys_o,
                          &new_masks_o, &width, &old_stamps_o, &new_stamps_o, &seed, &shift,
                          &limit, &old_zero, &new_zero)) {
        return NULL;
    }
    if (!PyTuple_Check(old_masks_o) || !PyTuple_Check(new_masks_o) ||
        PyTuple_GET_SIZE(old_masks_o) != PyTuple_GET_SIZE(new_masks_o) ||
        PyTuple_GET_SIZE(old_masks_o) < 1 || PyTuple_GET_SIZE(old_masks_o) > 3 || width < 1 ||
        (old_stamps_o == Py_None) != (new_stamps_o == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "relayout: one to three tiers' masks, old and new");
        return NULL;
    }
    Py_ssize_t tiers = PyTuple_GET_SIZE(old_masks_o), members = 64 * width;
    Buf old_keys = {0}, new_keys = {0}, old_stamps = {0}, new_stamps = {0};
    Buf old_masks[3], new_masks[3];
    memset(old_masks, 0, sizeof(old_masks));
    memset(new_masks, 0, sizeof(new_masks));
    SlotList *lists = NULL;
    PyObject *result = NULL;
    if (get(old_keys_o, &old_keys, 8, 0, "old_keys") < 0 ||
        get(new_keys_o, &new_keys, 8, 1, "new_keys") < 0 ||
        (old_stamps_o != Py_None && (get(old_stamps_o, &old_stamps, 4, 0, "old_stamps") < 0 ||
                                     get(new_stamps_o, &new_stamps, 4, 1, "new_stamps") < 0))) {
        goto done;
    }
    Py_ssize_t old_size = old_keys.view.len / 8, new_size = new_keys.view.len / 8;
    for (Py_ssize_t t = 0; t < tiers; t++) {
        if (get(PyTuple_GET_ITEM(old_masks_o, t), &old_masks[t], 8, 0, "old_masks") < 0 ||
            get(PyTuple_GET_ITEM(new_masks_o, t), &new_masks[t], 8, 1, "new_masks") < 0) {
            goto done;
        }
        if (old_masks[t].view.len / 8 != old_size * width ||
            new_masks[t].view.len / 8 != new_size * width) {
            PyErr_SetString(PyExc_ValueError, "relayout: masks of the wrong size");
            goto done;
        }
    }
    if (old_stamps.held &&
        (old_stamps.view.len / 4 != old_size || new_stamps.view.len / 4 != new_size)) {
        PyErr_SetString(PyExc_ValueError, "relayout: stamps of the wrong size");
        goto done;
    }
    if (old_zero < 0 || old_zero >= old_size || new_zero < 0 || new_zero >= new_size) {
        PyErr_SetString(PyExc_ValueError, "relayout: zero slots out of range");
        goto done;
    }
    lists = PyMem_RawCalloc((size_t)members, sizeof(SlotList));
    if (lists == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint64_t *ok = old_keys.view.buf;
    uint64_t *nk = new_keys.view.buf;
    const uint32_t *os = old_stamps.held ? old_stamps.view.buf : NULL;
    uint32_t *ns = new_stamps.held ? new_stamps.view.buf : NULL;
    Py_ssize_t live = 0, worst = 0;
    int zero_used = 0, status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < old_size && status == 0; s++) {
        int any = 0;
        for (Py_ssize_t t = 0; t < tiers && !any; t++) {
            const uint64_t *row = (const uint64_t *)old_masks[t].view.buf + s * width;
            for (Py_ssize_t w = 0; w < width; w++) {
                if (row[w]) {
                    any = 1;
                    break;
                }
            }
        }
        if (!any) continue;
        Py_ssize_t at;
        if (s == old_zero) {
            at = new_zero;
            zero_used = 1;
        } else {
            uint64_t key = ok[s];
            Py_ssize_t home = home_of(key, seed, shift);
            at = home;
            while (at < new_size && at - home <= limit && nk[at] != 0) at++;
            if (at >= new_size || at - home > limit) {
                status = -1;
                break;
            }
            nk[at] = key;
            if (at - home > worst) worst = at - home;
        }
        live++;
        if (ns != NULL) ns[at] = os[s];
        for (Py_ssize_t w = 0; w < width; w++) {
            uint64_t held = 0;
            for (Py_ssize_t t = 0; t < tiers; t++) {
                uint64_t bits = ((const uint64_t *)old_masks[t].view.buf)[s * width + w];
                ((uint64_t *)new_masks[t].view.buf)[at * width + w] = bits;
                held |= bits;
            }
            while (held) {
                int b = __builtin_ctzll(held);
                held &= held - 1;
                if (slot_push(&lists[w * 64 + b], (uint32_t)at) < 0) {
                    status = -2;
                    break;
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (status == -2) {
        PyErr_NoMemory();
        goto done;
    }
    if (status == -1) {
        result = Py_NewRef(Py_None); /* TableFull */
        goto done;
    }
    PyObject *records = PyList_New(0);
    if (records == NULL) goto done;
    for (Py_ssize_t m = 0; m < members; m++) {
        if (!lists[m].n) continue;
        PyObject *item = Py_BuildValue("(ny#)", m, (const char *)lists[m].slots,
                                       (Py_ssize_t)(lists[m].n * sizeof(uint32_t)));
        if (item == NULL || PyList_Append(records, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(records);
            goto done;
        }
        Py_DECREF(item);
    }
    result = Py_BuildValue("(nnON)", live, worst, zero_used ? Py_True : Py_False, records);
done:
    if (lists != NULL) {
        for (Py_ssize_t m = 0; m < members; m++) PyMem_RawFree(lists[m].slots);
        PyMem_RawFree(lists);
    }
    release(&old_keys);
    release(&new_keys);
    release(&old_stamps);
    release(&new_stamps);
    for (Py_ssize_t t = 0; t < 3; t++) {
        release(&old_masks[t]);
        release(&new_masks[t]);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"relayout", probe_relayout, METH_VARARGS,
     "A rebuild in one pass: live slots re-placed, rows moved, records rebuilt."},
    {"store", probe_store, METH_VARARGS,
     "One member stores one copy of each key in one tier: slots, bits, counters."},
    {"move_rows", probe_move_rows, METH_VARARGS, "dst[dst_rows] = src[src_rows], row by row."},
    {"distinct", probe_distinct, METH_O, "Whether no value of an int64 buffer repeats."},
    {"find", probe_find, METH_VARARGS, "Slots of keys (-1 absent), and insert cursors."},
    {"insert", probe_insert, METH_VARARGS, "Place absent keys; largest displacement or -1."},
    {"layout", probe_layout, METH_VARARGS, "Lay keys out in an empty table; displacement."},
    {"walk", probe_walk, METH_VARARGS, "Each member's longest held prefix, best first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_probe", "Compiled probing kernels of the memory table.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
