/* /route's one-pass candidate loop (scoring/route/one_pass.py), compiled: the loop runs for
 * every candidate of every /route request, and interpreted it cost more than the rest of
 * the decision.
 *
 * rows(pods, matches, speculative, loads, in_flight, heard, podload_type, row,
 *      refusal, consts)
 *   -> None | (rows, totals, load_terms, usables, admitted, dropped, refused)
 *
 * rows: row(...) per pod; dropped: the pods that restarted unheard; refused: "pod: why"
 * for each pod refused admission. None where a pod has several engines (the general
 * path decides). consts = (load_only, prompt_tokens, block_size, total_blocks, cap,
 * w_prefix, w_queue, w_decode, w_kv, max_kv, max_waiting, pending_waiting, future,
 * busiest_sharing, busiest_queued): route_pass._kernel_consts.
 *
 * The cost is route_cost.pod_costs, the formula's Python reference, term for term: the
 * same double operations in the same order (built with -ffp-contract=off, so no fused
 * multiply-add). Every per-pod count is read clamped to 0..COUNT_MAX, as
 * route_pass._rows_python clamps it, so neither a sum of two nor a count times the
 * prompt's tokens (bounded by the request limits) overflows 64 bits, whatever a scraped
 * page says. tests/test_route_pass.py compares every row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* An attribute read by name, the way PyObject_GetAttr reads it, but for the slot of a
 * msgspec Struct or slots dataclass (a member descriptor) straight from the object at
 * the slot's offset, which is resolved once per type: the loop reads a dozen attributes
 * per pod. Anything else (a property, a subclass overriding the name, an empty slot) goes
 * through PyObject_GetAttr. */
typedef struct {
    const char *text;
    PyObject *name;
    PyTypeObject *type; /* the type the offset belongs to (a strong reference) */
    Py_ssize_t offset;  /* -1: not a plain object slot on that type */
} Field;

#define FIELD(name_text) {.text = (name_text), .offset = -1}
static Field f_engines = FIELD("engines"), f_running = FIELD("running"), f_waiting = FIELD("waiting"),
             f_kv_usage = FIELD("kv_usage"), f_kv_usage_max = FIELD("kv_usage_max"),
             f_started = FIELD("started"), f_reason = FIELD("reason"), f_ts = FIELD("ts"),
             f_requests = FIELD("requests"), f_prefilling = FIELD("prefilling"),
             f_prefill_tokens = FIELD("prefill_tokens"), f_matched_blocks = FIELD("matched_blocks"),
             f_score = FIELD("score"), f_sessions = FIELD("sessions");
static Field *const fields[] = {
    &f_engines,  &f_running,     &f_waiting,        &f_kv_usage,       &f_kv_usage_max,
    &f_started,  &f_reason,      &f_ts,             &f_requests,       &f_prefilling,
    &f_prefill_tokens, &f_matched_blocks, &f_score, &f_sessions,
};
static PyObject *s_known, *s_pending, *s_both;

static PyObject *get(PyObject *obj, Field *f) {
    PyTypeObject *type = Py_TYPE(obj);
    if (type != f->type) {
        f->offset = -1;
        PyObject *descr = _PyType_Lookup(type, f->name); /* borrowed */
        if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == T_OBJECT_EX && !(member->flags & PY_AUDIT_READ))
                f->offset = member->offset;
        }
        Py_INCREF(type);
        Py_XSETREF(f->type, type);
    }
    if (f->offset >= 0) {
        PyObject *value = *(PyObject **)((char *)obj + f->offset);
        if (value != NULL) return Py_NewRef(value);
    }
    return PyObject_GetAttr(obj, f->name);
}

/* route_pass.COUNT_MAX: the largest per-pod count the loop reads as it is. */
#define COUNT_MAX 2147483647LL

/* An integer clamped to 0..COUNT_MAX (route_pass._count); -1 with an exception set when
 * it is no integer. */
static int as_count(PyObject *v, long long *out) {
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (value == -1 && !overflow && PyErr_Occurred()) return -1;
    if (overflow > 0 || value > COUNT_MAX) value = COUNT_MAX;
    else if (overflow < 0 || value < 0) value = 0;
    *out = value;
    return 0;
}

/* An attribute as a count (as_count); -1 with an exception set on failure. */
static int attr_count(PyObject *obj, Field *name, long long *out) {
    PyObject *v = get(obj, name);
    if (v == NULL) return -1;
    int rc = as_count(v, out);
    Py_DECREF(v);
    return rc;
}

/* An attribute as a double (an int or a float); -1 with an exception set on failure. */
static int attr_double(PyObject *obj, Field *name, double *out) {
    PyObject *v = get(obj, name);
    if (v == NULL) return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* Append a new reference and drop it; -1 on failure (the reference is dropped). */
static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

static PyObject *rows(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *pods, *matches, *speculative, *loads, *in_flight, *heard, *podload_type, *row,
        *refusal, *consts;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!OOOO!", &PyList_Type, &pods, &PyDict_Type,
                          &matches, &PyDict_Type, &speculative, &PyDict_Type, &loads,
                          &PyDict_Type, &in_flight, &PyDict_Type, &heard, &podload_type, &row,
                          &refusal, &PyTuple_Type, &consts))
        return NULL;
    int load_only;
    long long prompt_tokens, block_size, total_blocks, cap, max_waiting, pending_waiting;
    long long busiest_queued;
    double w_prefix, w_queue, w_decode, w_kv, max_kv, future, busiest_sharing;
    if (!PyArg_ParseTuple(consts, "pLLLLdddddLLddL", &load_only, &prompt_tokens, &block_size,
                          &total_blocks, &cap, &w_prefix, &w_queue, &w_decode, &w_kv, &max_kv,
                          &max_waiting, &pending_waiting, &future, &busiest_sharing,
                          &busiest_queued))
        return NULL;

    Py_ssize_t n = PyList_GET_SIZE(pods);
    PyObject *out_rows = PyList_New(0), *totals = PyList_New(0), *load_terms = PyList_New(0),
             *usables = PyList_New(0), *admitted = PyList_New(0), *dropped = PyList_New(0),
             *refusals = PyList_New(0);
    PyObject *result = NULL;
    if (!out_rows || !totals || !load_terms || !usables || !admitted || !dropped || !refusals)
        goto done;

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pod = PyList_GET_ITEM(pods, i);
        PyObject *load = PyDict_GetItemWithError(loads, pod); /* borrowed */
        if (load == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, pod);
            goto done;
        }
        /* The load: known (a PodLoad), pending, or unknown. */
        int known = Py_TYPE(load) == (PyTypeObject *)podload_type;
        int have_waiting = 1;
        long long running = 0, waiting = 0;
        PyObject *state = NULL, *kv_usage = NULL, *kv_max = NULL; /* new references */
        double started = 0.0;
        int have_started = 0;
        if (known) {
            PyObject *engines = get(load, &f_engines);
            if (engines == NULL) goto done;
            Py_ssize_t count = PyObject_Length(engines);
            Py_DECREF(engines);
            if (count < 0) goto done;
            if (count > 1) { /* one target per engine: the general path */
                result = Py_NewRef(Py_None);
                goto done;
            }
            state = Py_NewRef(s_known);
            if (attr_count(load, &f_running, &running) < 0 ||
                attr_count(load, &f_waiting, &waiting) < 0)
                goto pod_failed;
            kv_usage = get(load, &f_kv_usage);
            kv_max = kv_usage ? get(load, &f_kv_usage_max) : NULL;
            if (kv_max == NULL) goto pod_failed;
            PyObject *start = get(load, &f_started);
            if (start == NULL) goto pod_failed;
            if (start != Py_None) {
                started = PyFloat_AsDouble(start);
                have_started = 1;
            }
            Py_DECREF(start);
            if (have_started && started == -1.0 && PyErr_Occurred()) goto pod_failed;
        } else {
            state = get(load, &f_reason);
            if (state == NULL) goto done;
            kv_max = Py_NewRef(Py_None);
            int pending = PyUnicode_Check(state) && PyUnicode_Compare(state, s_pending) == 0;
            if (pending) {
                waiting = pending_waiting;
                kv_usage = PyFloat_FromDouble(0.0);
                if (kv_usage == NULL) goto pod_failed;
            } else {
                have_waiting = 0;
                kv_usage = Py_NewRef(Py_None);
            }
        }

        /* The index's word on it: its match and speculative blocks, unless it restarted
         * unheard (its server started after the last batch the index applied from it). */
        PyObject *match = PyDict_GetItemWithError(matches, pod); /* borrowed */
        if (match == NULL && PyErr_Occurred()) goto pod_failed;
        long long extra = 0;
        PyObject *extra_obj = PyDict_GetItemWithError(speculative, pod);
        if (extra_obj == NULL && PyErr_Occurred()) goto pod_failed;
        if (extra_obj != NULL && as_count(extra_obj, &extra) < 0) goto pod_failed;
        if (have_started && (match != NULL || extra_obj != NULL)) {
            PyObject *lag = PyDict_GetItemWithError(heard, pod);
            if (lag == NULL && PyErr_Occurred()) goto pod_failed;
            if (lag != NULL) {
                PyObject *ts = get(lag, &f_ts);
                if (ts == NULL) goto pod_failed;
                if (ts != Py_None) {
                    double at = PyFloat_AsDouble(ts);
                    Py_DECREF(ts);
                    if (at == -1.0 && PyErr_Occurred()) goto pod_failed;
                    if (at < started) {
                        if (PyList_Append(dropped, pod) < 0) goto pod_failed;
                        match = NULL;
                        extra = 0;
                    }
                } else {
                    Py_DECREF(ts);
                }
            }
        }

        long long flying = 0, prefilling = 0, prefill_tokens = 0;
        double sessions = 0.0;
        PyObject *entry = PyDict_GetItemWithError(in_flight, pod);
        if (entry == NULL && PyErr_Occurred()) goto pod_failed;
        if (entry != NULL) {
            if (attr_count(entry, &f_requests, &flying) < 0 ||
                attr_count(entry, &f_prefilling, &prefilling) < 0 ||
                attr_count(entry, &f_prefill_tokens, &prefill_tokens) < 0 ||
                attr_double(entry, &f_sessions, &sessions) < 0)
                goto pod_failed;
        }
        long long confirmed = 0;
        double weighted = 0.0;
        if (match != NULL) {
            if (attr_count(match, &f_matched_blocks, &confirmed) < 0) goto pod_failed;
            PyObject *score = get(match, &f_score);
            if (score == NULL) goto pod_failed;
            weighted = PyFloat_AsDouble(score);
            Py_DECREF(score);
            if (weighted == -1.0 && PyErr_Occurred()) goto pod_failed;
        }

        /* route_cost.pod_costs, term for term */
        long long matched = confirmed + extra;
        weighted = weighted + (double)extra;
        long long usable = matched < cap ? matched : cap;
        double hit = usable > 0 ? weighted * (double)usable / (double)matched : 0.0;
        double uncached = (double)total_blocks > hit ? (double)total_blocks - hit : 0.0;
        double own = load_only ? (double)prompt_tokens
                               : (double)prompt_tokens - hit * (double)block_size;
        long long queued;
        double sharing, usage;
        if (!have_waiting) {
            /* never lighter than the busiest known candidate (route_cost.busiest_known) */
            sharing = (double)(flying + 1) + sessions;
            if (sharing < busiest_sharing) sharing = busiest_sharing;
            queued = prefill_tokens + prompt_tokens;
            if (queued < busiest_queued) queued = busiest_queued;
            usage = 1.0;
        } else {
            long long requests = running + waiting;
            if (flying > requests) requests = flying;
            sharing = (double)requests + sessions;
            long long foreign = waiting - prefilling;
            queued = prefill_tokens + (foreign > 0 ? foreign * prompt_tokens : 0);
            if (kv_usage == Py_None) {
                usage = 1.0;
            } else {
                usage = PyFloat_AsDouble(kv_usage);
                if (usage == -1.0 && PyErr_Occurred()) goto pod_failed;
                if (usage < 0.0 || usage > 1.0) usage = usage < 0.0 ? 0.0 : 1.0;
            }
        }
        double prefix = w_prefix * own;
        double queue = w_queue * (double)queued;
        double decode = w_decode * sharing * (own + future);
        double kv = w_kv * usage;
        double total = prefix + queue + decode + kv;

        /* Admission */
        int refuse = 0;
        if (kv_max != Py_None) {
            double top = PyFloat_AsDouble(kv_max);
            if (top == -1.0 && PyErr_Occurred()) goto pod_failed;
            refuse = top > max_kv;
        }
        if (!refuse && max_waiting && have_waiting && waiting > max_waiting) refuse = 1;
        PyObject *refused;
        if (refuse) {
            PyObject *waiting_obj = have_waiting ? PyLong_FromLongLong(waiting) : Py_NewRef(Py_None);
            if (waiting_obj == NULL) goto pod_failed;
            refused = PyObject_CallFunctionObjArgs(refusal, kv_max, waiting_obj, NULL);
            Py_DECREF(waiting_obj);
            if (refused == NULL) goto pod_failed;
            if (append_new(refusals, PyUnicode_FromFormat("%U: %S", pod, refused)) < 0) {
                Py_DECREF(refused);
                goto pod_failed;
            }
        } else {
            refused = Py_NewRef(Py_None);
            if (append_new(admitted, PyLong_FromSsize_t(i)) < 0) {
                Py_DECREF(refused);
                goto pod_failed;
            }
        }
        if (append_new(totals, PyFloat_FromDouble(total)) < 0 ||
            (load_only && append_new(load_terms, PyFloat_FromDouble(queue + decode + kv)) < 0) ||
            append_new(usables, PyLong_FromLongLong(usable)) < 0) {
            Py_DECREF(refused);
            goto pod_failed;
        }

        /* The answer row: row(pod, rank, role, matched, speculative, usable, uncached,
         * load, running, waiting, kv_usage, in_flight, sessions, queued_tokens, prefix,
         * queue, decode, kv, cost, admitted, refused) */
        PyObject *argv[21];
        argv[0] = Py_NewRef(pod);
        argv[1] = PyLong_FromLong(0);
        argv[2] = Py_NewRef(s_both);
        argv[3] = PyLong_FromLongLong(confirmed);
        argv[4] = PyLong_FromLongLong(extra);
        argv[5] = PyLong_FromLongLong(usable);
        argv[6] = PyFloat_FromDouble(uncached);
        argv[7] = Py_NewRef(state);
        argv[8] = known ? PyLong_FromLongLong(running) : Py_NewRef(Py_None);
        argv[9] = have_waiting ? PyLong_FromLongLong(waiting) : Py_NewRef(Py_None);
        argv[10] = Py_NewRef(kv_usage);
        argv[11] = PyLong_FromLongLong(flying);
        argv[12] = PyFloat_FromDouble(sessions);
        argv[13] = PyLong_FromLongLong(prefill_tokens);
        argv[14] = PyFloat_FromDouble(prefix);
        argv[15] = PyFloat_FromDouble(queue);
        argv[16] = PyFloat_FromDouble(decode);
        argv[17] = PyFloat_FromDouble(kv);
        argv[18] = PyFloat_FromDouble(total);
        argv[19] = Py_NewRef(refused == Py_None ? Py_True : Py_False);
        argv[20] = refused; /* the reference moves to argv */
        int complete = 1;
        for (int k = 0; k < 21; k++) complete &= argv[k] != NULL;
        PyObject *made = complete ? PyObject_Vectorcall(row, argv, 21, NULL) : NULL;
        for (int k = 0; k < 21; k++) Py_XDECREF(argv[k]);
        if (append_new(out_rows, made) < 0) goto pod_failed;
        Py_DECREF(state);
        Py_DECREF(kv_usage);
        Py_DECREF(kv_max);
        continue;
    pod_failed:
        Py_XDECREF(state);
        Py_XDECREF(kv_usage);
        Py_XDECREF(kv_max);
        goto done;
    }
    result = PyTuple_Pack(7, out_rows, totals, load_terms, usables, admitted, dropped, refusals);
done:
    Py_XDECREF(refusals);
    Py_XDECREF(out_rows);
    Py_XDECREF(totals);
    Py_XDECREF(load_terms);
    Py_XDECREF(usables);
    Py_XDECREF(admitted);
    Py_XDECREF(dropped);
    return result;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_VARARGS, "The one-pass /route loop over the candidate pods."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_route_pass", "/route's one-pass candidate loop, compiled.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__route_pass(void) {
    for (size_t k = 0; k < sizeof(fields) / sizeof(fields[0]); k++) {
        fields[k]->name = PyUnicode_InternFromString(fields[k]->text);
        if (fields[k]->name == NULL) return NULL;
    }
    s_known = PyUnicode_InternFromString("known");
    s_pending = PyUnicode_InternFromString("pending");
    s_both = PyUnicode_InternFromString("both");
    if (s_known == NULL || s_pending == NULL || s_both == NULL) return NULL;
    return PyModule_Create(&module);
}
