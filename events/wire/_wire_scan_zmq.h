/* Receiving KV-event messages straight from libzmq, scanned and grouped (the receiver's
 * drain, events/wire/_wire_scan.c).
 *
 * Only _wire_scan.c includes this. Why: pyzmq pays per 3-frame message for a Frame
 * object per part, the part's bytes and the GIL, a large share of what ingest may spend
 * on a one-event message (bench/README.md). Here one call takes up to `limit`
 * messages off a SUB socket without the GIL, checks their framing, scans each payload
 * and groups consecutive messages of one sender (same topic and sender address,
 * consecutive seqs, same rank and layout) into one scan, as ScannedBatch.merge would.
 *
 * libzmq is the very library pyzmq uses: its functions are looked up through pyzmq's
 * own extension module (dlopen with RTLD_NOLOAD, then dlsym, which searches that
 * module's dependencies), and the caller checks the version. The socket is pyzmq's
 * (`Socket.underlying`), used only by the thread that owns it, as pyzmq would. Nothing
 * here is needed: without it the receiver reads with pyzmq. */
#ifndef KVINDEX_WIRE_SCAN_ZMQ_H
#define KVINDEX_WIRE_SCAN_ZMQ_H

#include <dlfcn.h>
#include <errno.h>

/* libzmq 4.x's zmq_msg_t: 64 opaque bytes, pointer-aligned. */
typedef struct {
    unsigned char _[64] __attribute__((aligned(sizeof(void *))));
} zmsg_t;

#define Z_DONTWAIT 1

static struct {
    int (*msg_init)(zmsg_t *);
    int (*msg_recv)(zmsg_t *, void *, int);
    void *(*msg_data)(zmsg_t *);
    size_t (*msg_size)(const zmsg_t *);
    int (*msg_more)(const zmsg_t *);
    int (*msg_close)(zmsg_t *);
    const char *(*msg_gets)(const zmsg_t *, const char *);
    int (*errno_)(void);
    void (*version)(int *, int *, int *);
} Z;
static int z_bound = 0;

/* bind(module_path) -> (major, minor, patch): find libzmq's functions through the
 * already loaded module at module_path (pyzmq's backend). OSError when they are not
 * there. */
static PyObject *zmq_bind(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL) {
        PyErr_Format(PyExc_OSError, "%s is not loaded: %s", path, dlerror());
        return NULL;
    }
    struct { const char *name; void **slot; } want[] = {
        {"zmq_msg_init", (void **)&Z.msg_init}, {"zmq_msg_recv", (void **)&Z.msg_recv},
        {"zmq_msg_data", (void **)&Z.msg_data}, {"zmq_msg_size", (void **)&Z.msg_size},
        {"zmq_msg_more", (void **)&Z.msg_more}, {"zmq_msg_close", (void **)&Z.msg_close},
        {"zmq_msg_gets", (void **)&Z.msg_gets}, {"zmq_errno", (void **)&Z.errno_},
        {"zmq_version", (void **)&Z.version},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        void *fn = dlsym(handle, want[i].name);
        if (fn == NULL) {
            z_bound = 0;
            PyErr_Format(PyExc_OSError, "%s not found through %s", want[i].name, path);
            return NULL; /* the handle stays: the module is loaded anyway */
        }
        *want[i].slot = fn;
    }
    int major, minor, patch;
    Z.version(&major, &minor, &patch);
    z_bound = 1;
    return Py_BuildValue("(iii)", major, minor, patch);
}

/* One received message. */
typedef struct {
    zmsg_t frames[3];
    int kept;     /* frames open (at most 3) */
    int nframes;  /* frames the message had */
    char peer[64];
    int has_peer;
    int kind;     /* D_GROUPED, D_SINGLE (the scanner does not take it), D_BAD */
    const char *reason; /* D_BAD */
    size_t detail;      /* D_BAD: the number the reason is about */
    uint64_t seq;
    int group;          /* D_GROUPED: its group */
} Msg;

enum { D_GROUPED = 0, D_SINGLE = 1, D_BAD = 2 };

/* A group of consecutive messages: its ranges in the accumulated arrays. */
typedef struct {
    int first_msg, parts;
    uint64_t last_seq;
    int has_rank;
    uint64_t rank;
    int is_map;
    size_t hash0, run0, span0, stamp0;
    uint32_t events;
} Group;

/* Everything the groups of one drain call scanned, one after another. */
typedef struct {
    Scan acc; /* hashes, runs and spans of every group (runs never join across groups) */
    double *stamps;
    size_t n_stamps, cap_stamps;
    int own_stamps;
    Group *groups;
    size_t n_groups, cap_groups;
    int own_groups;
} Acc;

static int frame_eq(zmsg_t *a, zmsg_t *b) {
    size_t n = Z.msg_size(a);
    return n == Z.msg_size(b) && memcmp(Z.msg_data(a), Z.msg_data(b), n) == 0;
}

/* Append message m's scan `s` to group g (positions moved past what g holds). */
static int group_add(Acc *a, Group *g, Scan *s) {
    Scan *acc = &a->acc;
    uint32_t hash_base = (uint32_t)(acc->n_hashes - g->hash0);
    for (size_t i = 0; i < s->n_hashes; i++) {
        if (push_hash(acc, s->hashes[i]) < 0) return -1;
    }
    for (size_t i = 0; i < s->n_runs; i++) {
        Run r = s->runs[i];
        r.first += g->events, r.start += hash_base, r.stop += hash_base;
        if (acc->n_runs > g->run0) {
            Run *last = &acc->runs[acc->n_runs - 1];
            if (last->first + last->count == r.first && last->stop == r.start &&
                key_eq(&last->key, &r.key)) {
                last->count += r.count;
                last->stop = r.stop;
                continue;
            }
        }
        if (acc->n_runs == acc->cap_runs &&
            grow((void **)&acc->runs, &acc->cap_runs, &acc->own_runs, sizeof(Run)) < 0) {
            return -1;
        }
        acc->runs[acc->n_runs++] = r;
    }
    for (size_t i = 0; i < s->n_spans; i += 3) {
        if (push_span(acc, s->spans[i + 1], s->spans[i + 2]) < 0) return -1;
        acc->spans[acc->n_spans - 3] = (uint32_t)g->parts;
    }
    if (a->n_stamps == a->cap_stamps &&
        grow((void **)&a->stamps, &a->cap_stamps, &a->own_stamps, sizeof(double)) < 0) {
        return -1;
    }
    a->stamps[a->n_stamps++] = s->ts;
    g->events += (uint32_t)(s->n_spans / 3);
    g->parts++;
    if (s->is_map != -1) g->is_map = s->is_map;
    return 0;
}

/* Whether message m (scanned as `s`) continues group g. Seq 0 after 2**64 - 1 does not:
 * a group's seqs are first .. first + parts - 1 as Python ints, and the receiver's
 * Python path sees that 0 as seq going back (a restart), not as the next batch. */
static int continues(Msg *msgs, Group *g, Msg *m, Scan *s, int group_max) {
    Msg *first = &msgs[g->first_msg];
    return g->parts < group_max && g->last_seq != UINT64_MAX && m->seq == g->last_seq + 1 &&
           s->has_rank == g->has_rank &&
           s->rank == g->rank && (s->is_map == -1 || g->is_map == -1 || s->is_map == g->is_map) &&
           m->has_peer == first->has_peer && strcmp(m->peer, first->peer) == 0 &&
           frame_eq(&m->frames[0], &first->frames[0]);
}

/* Scan the well-framed messages and group them (no Python object touched). */
static int group_all(Msg *msgs, int n, Acc *a, size_t max_payload, int group_max) {
    SCAN_BUFFERS;
    Scan s;
    SCAN_INIT(s);
    Group *g = NULL;
    int status = 0;
    for (int i = 0; i < n; i++) {
        Msg *m = &msgs[i];
        if (m->nframes != 3) {
            m->kind = D_BAD, m->reason = "bad_frame_count", m->detail = (size_t)m->nframes;
            g = NULL;
            continue;
        }
        size_t seq_len = Z.msg_size(&m->frames[1]);
        size_t len = Z.msg_size(&m->frames[2]);
        if (seq_len != 8) {
            m->kind = D_BAD, m->reason = "bad_seq_frame", m->detail = seq_len;
            g = NULL;
            continue;
        }
        if (len > max_payload) {
            m->kind = D_BAD, m->reason = "payload_too_large", m->detail = len;
            g = NULL;
            continue;
        }
        m->seq = be64((const uint8_t *)Z.msg_data(&m->frames[1]));
        s.n_hashes = s.n_runs = s.n_spans = 0;
        s.is_map = -1;
        scan_payload(&s, (const uint8_t *)Z.msg_data(&m->frames[2]), len);
        if (len > UINT32_MAX || walk(&s) < 0) {
            m->kind = D_SINGLE; /* decoded (or refused, and counted) by msgspec */
            g = NULL;
            continue;
        }
        if (g == NULL || !continues(msgs, g, m, &s, group_max)) {
            if (a->n_groups == a->cap_groups &&
                grow((void **)&a->groups, &a->cap_groups, &a->own_groups, sizeof(Group)) < 0) {
                status = -1;
                break;
            }
            g = &a->groups[a->n_groups++];
            memset(g, 0, sizeof(*g));
            g->first_msg = i;
            g->has_rank = s.has_rank, g->rank = s.rank;
            g->is_map = -1;
            g->hash0 = a->acc.n_hashes, g->run0 = a->acc.n_runs;
            g->span0 = a->acc.n_spans, g->stamp0 = a->n_stamps;
        }
        if (group_add(a, g, &s) < 0) {
            status = -1;
            break;
        }
        g->last_seq = m->seq;
        m->kind = D_GROUPED;
        m->group = (int)(g - a->groups);
    }
    scan_free(&s);
    return status;
}

static PyObject *bytes_of(zmsg_t *frame) {
    return PyBytes_FromStringAndSize((const char *)Z.msg_data(frame), Z.msg_size(frame));
}

static PyObject *peer_of(Msg *m) {
    if (!m->has_peer) Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(m->peer, strlen(m->peer), "replace");
}

/* A group as (0, topic, peer, first seq, payloads, scan) with scan as scan() makes it. */
static PyObject *group_object(Msg *msgs, int n, Acc *a, size_t gi) {
    Group *g = &a->groups[gi];
    Group *next = gi + 1 < a->n_groups ? &a->groups[gi + 1] : NULL;
    Msg *first = &msgs[g->first_msg];
    Scan view = a->acc;
    view.hashes = a->acc.hashes + g->hash0;
    view.n_hashes = (next ? next->hash0 : a->acc.n_hashes) - g->hash0;
    view.runs = a->acc.runs + g->run0;
    view.n_runs = (next ? next->run0 : a->acc.n_runs) - g->run0;
    view.spans = a->acc.spans + g->span0;
    view.n_spans = (next ? next->span0 : a->acc.n_spans) - g->span0;
    view.has_rank = g->has_rank, view.rank = g->rank, view.is_map = g->is_map;
    PyObject *scanned = result(&view, a->stamps + g->stamp0, (size_t)g->parts);
    PyObject *payloads = PyTuple_New(g->parts);
    if (scanned == NULL || payloads == NULL) {
        Py_XDECREF(scanned);
        Py_XDECREF(payloads);
        return NULL;
    }
    Py_ssize_t k = 0;
    for (int i = g->first_msg; i < n && k < g->parts; i++) {
        if (msgs[i].kind != D_GROUPED || msgs[i].group != (int)gi) continue;
        PyObject *payload = bytes_of(&msgs[i].frames[2]);
        if (payload == NULL) {
            Py_DECREF(scanned);
            Py_DECREF(payloads);
            return NULL;
        }
        PyTuple_SET_ITEM(payloads, k++, payload);
    }
    return Py_BuildValue("(iNNKNN)", D_GROUPED, bytes_of(&first->frames[0]), peer_of(first),
                         (unsigned long long)first->seq, payloads, scanned);
}

/* A message outside every group: (1, frames, peer) or (2, reason, detail, peer). */
static PyObject *single_object(Msg *m) {
    if (m->kind == D_BAD) {
        return Py_BuildValue("(isnN)", D_BAD, m->reason, (Py_ssize_t)m->detail, peer_of(m));
    }
    PyObject *frames = PyList_New(3);
    if (frames == NULL) return NULL;
    for (int f = 0; f < 3; f++) {
        PyObject *b = bytes_of(&m->frames[f]);
        if (b == NULL) {
            Py_DECREF(frames);
            return NULL;
        }
        PyList_SET_ITEM(frames, f, b);
    }
    return Py_BuildValue("(iNN)", D_SINGLE, frames, peer_of(m));
}

/* Receive up to `limit` messages without waiting (no GIL held). */
static int receive(void *sock, Msg *msgs, int limit, int want_peer, int *error) {
    int n = 0;
    *error = 0;
    while (n < limit) {
        Msg *m = &msgs[n];
        m->kept = m->nframes = 0;
        m->has_peer = 0;
        m->peer[0] = 0;
        zmsg_t scratch;
        for (;;) {
            zmsg_t *frame = m->kept < 3 ? &m->frames[m->kept] : &scratch;
            Z.msg_init(frame);
            if (Z.msg_recv(frame, sock, Z_DONTWAIT) < 0) {
                int e = Z.errno_();
                Z.msg_close(frame);
                if (m->nframes == 0) { /* nothing of a new message: stop here */
                    if (e != EAGAIN && e != EINTR) *error = e;
                    return n;
                }
                /* ZMQ delivers messages whole: a part missing here is a broken socket */
                *error = e;
                m->nframes = -1;
                break;
            }
            if (m->nframes == 0 && want_peer) {
                const char *peer = Z.msg_gets(frame, "Peer-Address");
                if (peer != NULL) {
                    strncpy(m->peer, peer, sizeof(m->peer) - 1);
                    m->peer[sizeof(m->peer) - 1] = 0;
                    m->has_peer = peer[0] != 0;
                }
            }
            m->nframes++;
            int more = Z.msg_more(frame);
            if (frame == &scratch) {
                Z.msg_close(frame);
            } else {
                m->kept++;
            }
            if (!more) break;
        }
        n++;
        if (*error) return n;
    }
    return n;
}

/* drain(socket, limit, max_payload, peer, group_max) -> list of items, in arrival
 * order: (0, topic, peer, first seq, payloads, scan) for a group of messages,
 * (1, [topic, seq, payload], peer) for a message the scanner does not take,
 * (2, reason, detail, peer) for a badly framed one. `socket` is Socket.underlying;
 * `peer`: read each message's Peer-Address (else peer is None). */
static PyObject *zmq_drain(PyObject *self, PyObject *args) {
    unsigned long long address;
    int limit, want_peer, group_max;
    Py_ssize_t max_payload;
    if (!PyArg_ParseTuple(args, "Kinpi", &address, &limit, &max_payload, &want_peer,
                          &group_max)) {
        return NULL;
    }
    if (!z_bound) {
        PyErr_SetString(PyExc_RuntimeError, "drain: libzmq is not bound (bind() first)");
        return NULL;
    }
    if (limit < 1 || group_max < 1 || max_payload < 0 || address == 0) {
        PyErr_SetString(PyExc_ValueError, "drain: bad arguments");
        return NULL;
    }
    Msg *msgs = malloc(sizeof(Msg) * (size_t)limit);
    Acc a;
    memset(&a, 0, sizeof(a));
    double stamps_[256];
    Group groups_[64];
    SCAN_BUFFERS;
    SCAN_INIT(a.acc);
    a.stamps = stamps_, a.cap_stamps = 256;
    a.groups = groups_, a.cap_groups = 64;
    if (msgs == NULL) return PyErr_NoMemory();
    int n, error, status;
    Py_BEGIN_ALLOW_THREADS
    n = receive((void *)(uintptr_t)address, msgs, limit, want_peer, &error);
    status = group_all(msgs, n, &a, (size_t)max_payload, group_max);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (status < 0) {
        PyErr_NoMemory();
    } else if (n == 0 && error) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        out = PyList_New(0);
        for (int i = 0; out != NULL && i < n; i++) {
            Msg *m = &msgs[i];
            if (m->nframes < 0) continue; /* cut short by a broken socket: dropped */
            PyObject *item;
            if (m->kind == D_GROUPED) {
                if (a.groups[m->group].first_msg != i) continue; /* one item per group */
                item = group_object(msgs, n, &a, (size_t)m->group);
            } else {
                item = single_object(m);
            }
            if (item == NULL || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(item);
        }
    }
    for (int i = 0; i < n; i++) {
        for (int f = 0; f < msgs[i].kept; f++) Z.msg_close(&msgs[i].frames[f]);
    }
    free(msgs);
    scan_free(&a.acc);
    if (a.own_stamps) free(a.stamps);
    if (a.own_groups) free(a.groups);
    return out;
}

#endif /* KVINDEX_WIRE_SCAN_ZMQ_H */
