/* Compiled vLLM block-hash chain: indexer/keys.py BlockHasher's fast path.
 *
 * Why C: vLLM hashes block i as H((digest_{i-1}, tuple(tokens_i), extra_keys_i)), where H
 * is SHA-256 (or xxh3_128) of pickle.dumps(x, protocol=5) (or of canonical CBOR). In
 * Python each block builds a tuple, runs the pickler and calls hashlib, which adds up
 * over a long prompt. Here the serialisation is written straight into one buffer
 * (_chain_pickle.h, _chain_cbor.h: the exact bytes pickle and cbor2 write) and hashed in
 * place with OpenSSL's SHA-256 (SHA-NI where the CPU has it), so a block costs little
 * more than SHA-256 of its bytes (bench/bench_hash.py).
 *
 * xxhash variants call the digest function they are given (the Python xxhash module's
 * xxh3_128_digest) on the bytes written here: there is no xxhash library to link
 * against, and the call is small next to the pickling it replaces.
 *
 * What cannot be written here is left to the pure path, block by block: a token that
 * is not an exact int in [-2^63, 2^64), an extra key of another type (or nested deeper
 * than MAX_DEPTH, or with more than MEMO_SLOTS memoized objects), a str with lone
 * surrogates (pickle writes those with "surrogatepass", cbor2 raises). chain() stops
 * before such a block and says where; keys.py hashes that block and calls again.
 */
#include "_chain_writer.h"
#include "_chain_pickle.h"
#include "_chain_cbor.h"

/* The low-level SHA256_Init/Update are deprecated in OpenSSL 3.0 but built (Debian's
 * libssl3 has them) and are the cheapest call per hash: the EVP interfaces add a
 * context's bookkeeping, and SHA256() fetches the algorithm on every call. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>

#define SER_PICKLE 0
#define SER_CBOR 1

/* SHA-256 of w's bytes, padded in place (the writer keeps PAD_ROOM free after them):
 * one SHA256_Update over whole 64-byte blocks, the state read back, so no copy into the
 * context and no SHA256_Final. */
static void sha256_in_place(Writer *w, unsigned char *md) {
    Py_ssize_t n = w->len, total = (n + 9 + 63) & ~(Py_ssize_t)63;
    unsigned char *b = w->buf;
    uint64_t bits = (uint64_t)n * 8;
    memset(b + n, 0, PAD_ROOM); /* a fixed size: a few vector stores */
    b[n] = 0x80;
    for (int i = 0; i < 8; i++) {
        b[total - 1 - i] = (unsigned char)(bits >> (8 * i));
    }
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, b, (size_t)total);
    for (int i = 0; i < 8; i++) {
        uint32_t h = ctx.h[i];
        md[4 * i] = (unsigned char)(h >> 24);
        md[4 * i + 1] = (unsigned char)(h >> 16);
        md[4 * i + 2] = (unsigned char)(h >> 8);
        md[4 * i + 3] = (unsigned char)h;
    }
}

static uint64_t published(const unsigned char *digest, Py_ssize_t n) {
    uint64_t key = 0;
    for (Py_ssize_t i = n > 8 ? n - 8 : 0; i < n; i++) {
        key = (key << 8) | digest[i];
    }
    return key;
}

/* One block's hash input into w, chained from `parent`. `extra_template` is the extra
 * keys' pickle when it can be copied in (pickle_fast), else NULL: not for a block whose
 * parent object the extra keys could hold too (the pickler would refer to it). */
static int write_block(Writer *w, int serialisation, const char *parent, Py_ssize_t parent_len,
                       PyObject *parent_obj, const Tokens *t, Py_ssize_t start,
                       Py_ssize_t size, Py_ssize_t look, PyObject *extra,
                       const Template *extra_template) {
    if (serialisation == SER_CBOR) {
        return cbor_block(w, parent, parent_len, t, start, size, look, extra);
    }
    if (extra_template != NULL && fast_fits(parent_len, size, look, extra_template)) {
        return pickle_fast(w, parent, parent_len, t, start, size, look, extra_template);
    }
    return pickle_block(w, parent, parent_len, parent_obj, t, start, size, look, extra);
}

typedef struct {
    int serialisation;
    PyObject *digest_fn; /* None: SHA-256 here */
    Py_ssize_t size, look, start, count, first_index;
    PyObject *extra_first, *extra_rest;
} Chain;

/* Hash blocks c->start.. into keys (and digests); *next = the first block not hashed,
 * *last = the digest it chains from (a new reference). */
static int run_chain(const Chain *c, const Tokens *t, PyObject *parent_o, Writer *w,
                     PyObject *keys, PyObject *digests, Py_ssize_t *next, PyObject **last) {
    unsigned char sha[32];
    const char *prev = PyBytes_AS_STRING(parent_o);
    Py_ssize_t prev_len = PyBytes_GET_SIZE(parent_o);
    PyObject *prev_obj = Py_NewRef(parent_o); /* NULL while the digest lives in `sha` */
    Template none, rest;
    template_of(w, Py_None, &none);
    int status = c->serialisation == SER_PICKLE ? template_of(w, c->extra_rest, &rest) : UNSUPPORTED;
    if (status == FAILED) {
        goto fail;
    }
    const Template *rest_template = status == OK ? &rest : NULL;
    Py_ssize_t i = c->start;
    for (; i < c->count; i++) {
        PyObject *extra = c->first_index + i == 0 ? c->extra_first : c->extra_rest;
        /* Only the caller's parent object could be met again inside the extra keys
         * (later parents are digests made here), so only its block has to track it. */
        PyObject *identity = i == c->start ? parent_o : NULL;
        const Template *template = extra == Py_None                      ? &none
                                   : extra == c->extra_rest && i > c->start ? rest_template
                                                                            : NULL;
        status = write_block(w, c->serialisation, prev, prev_len, identity, t, i * c->size,
                             c->size, c->look, extra, template);
        if (status == FAILED) {
            goto fail;
        }
        if (status == UNSUPPORTED) {
            break;
        }
        PyObject *digest = NULL;
        const unsigned char *md = sha;
        Py_ssize_t md_len = 32;
        if (c->digest_fn == Py_None) {
            sha256_in_place(w, sha);
        } else {
            PyObject *data = PyBytes_FromStringAndSize((const char *)w->buf, w->len);
            if (data == NULL) {
                goto fail;
            }
            digest = PyObject_CallOneArg(c->digest_fn, data);
            Py_DECREF(data);
            if (digest == NULL) {
                goto fail;
            }
            if (!PyBytes_CheckExact(digest)) {
                Py_DECREF(digest);
                PyErr_SetString(PyExc_TypeError, "chain(): digest() must return bytes");
                goto fail;
            }
            md = (const unsigned char *)PyBytes_AS_STRING(digest);
            md_len = PyBytes_GET_SIZE(digest);
        }
        PyObject *key = PyLong_FromUnsignedLongLong(published(md, md_len));
        if (key == NULL) {
            Py_XDECREF(digest);
            goto fail;
        }
        PyList_SET_ITEM(keys, i - c->start, key);
        if (digests != NULL) {
            if (digest == NULL &&
                (digest = PyBytes_FromStringAndSize((const char *)md, md_len)) == NULL) {
                goto fail;
            }
            PyList_SET_ITEM(digests, i - c->start, Py_NewRef(digest));
        }
        /* The next block copies its parent into the buffer before `sha` is written
         * again, so a SHA-256 digest needs no object. */
        Py_XSETREF(prev_obj, digest);
        prev = digest != NULL ? PyBytes_AS_STRING(digest) : (const char *)sha;
        prev_len = md_len;
    }
    if (prev_obj == NULL && (prev_obj = PyBytes_FromStringAndSize(prev, prev_len)) == NULL) {
        return FAILED;
    }
    *next = i;
    *last = prev_obj;
    return OK;
fail:
    Py_XDECREF(prev_obj);
    return FAILED;
}

/* Drop the unset tail of a list made with PyList_New(n) (items from `used` on). */
static int drop_unset(PyObject *list, Py_ssize_t used) {
    if (list == NULL || used == PyList_GET_SIZE(list)) {
        return OK;
    }
    return PyList_SetSlice(list, used, PyList_GET_SIZE(list), NULL);
}

PyDoc_STRVAR(chain_doc,
"chain(serialisation, digest, tokens, block_size, lookahead, start, count, parent,\n"
"      extra_first, extra_rest, first_index, want_digests)\n"
"    -> (keys, digests, next, last_digest)\n"
"\n"
"Hash blocks start..count-1 of tokens as vLLM does, chained from the bytes `parent`.\n"
"serialisation: 0 pickle protocol 5, 1 canonical CBOR. digest: None for SHA-256, else\n"
"a callable bytes -> digest bytes (xxhash.xxh3_128_digest). A block's extra keys are\n"
"extra_first when first_index + block == 0, else extra_rest (None: no extras). keys:\n"
"each hashed block's published uint64; digests: their digests (None unless asked).\n"
"next: the first block not hashed (count, or a block the pure path must hash);\n"
"last_digest: the digest it chains from.");

static PyObject *chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "chain() takes 12 arguments");
        return NULL;
    }
    Chain c;
    c.serialisation = PyLong_AsLong(args[0]) == SER_CBOR ? SER_CBOR : SER_PICKLE;
    c.digest_fn = args[1];
    c.size = PyLong_AsSsize_t(args[3]);
    c.look = PyLong_AsSsize_t(args[4]);
    c.start = PyLong_AsSsize_t(args[5]);
    c.count = PyLong_AsSsize_t(args[6]);
    c.extra_first = args[8];
    c.extra_rest = args[9];
    c.first_index = PyLong_AsSsize_t(args[10]);
    int want_digests = PyObject_IsTrue(args[11]);
    PyObject *parent = args[7];
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!PyBytes_CheckExact(parent) || (c.digest_fn != Py_None && !PyCallable_Check(c.digest_fn))) {
        PyErr_SetString(PyExc_TypeError, "chain(): parent must be bytes, digest None or callable");
        return NULL;
    }
    if (c.size <= 0 || c.look < 0 || c.start < 0 || c.first_index < 0) {
        PyErr_SetString(PyExc_ValueError, "chain(): bad block size, lookahead or start");
        return NULL;
    }
    if (c.count < c.start) {
        c.count = c.start;
    }
    Tokens t;
    if (tokens_open(args[2], &t) != OK) {
        return NULL;
    }
    PyObject *keys = NULL, *digests = NULL, *last = NULL, *result = NULL;
    Writer *w = NULL;
    Py_ssize_t next = c.start;
    if (c.count > 0 && c.count > (t.n - c.look) / c.size) {
        PyErr_SetString(PyExc_ValueError, "chain(): more blocks than tokens");
        goto done;
    }
    if ((w = writer_new()) == NULL || (keys = PyList_New(c.count - c.start)) == NULL ||
        (want_digests && (digests = PyList_New(c.count - c.start)) == NULL)) {
        goto done;
    }
    if (run_chain(&c, &t, parent, w, keys, digests, &next, &last) != OK ||
        drop_unset(keys, next - c.start) != OK || drop_unset(digests, next - c.start) != OK) {
        goto done;
    }
    result = Py_BuildValue("OOnO", keys, digests != NULL ? digests : Py_None, next, last);
done:
    /* on failure, the lists' unset items are NULL, which list_dealloc skips */
    Py_XDECREF(keys);
    Py_XDECREF(digests);
    Py_XDECREF(last);
    if (w != NULL) {
        writer_free(w);
    }
    tokens_close(&t);
    return result;
}

PyDoc_STRVAR(serialise_doc,
"serialise(serialisation, tokens, block_size, lookahead, start, parent, extra, fast)\n"
"    -> bytes | None\n"
"\n"
"The hash input chain() writes for the block of tokens at token index `start`, or\n"
"None where the pure path must serialise it. For tests: it must equal\n"
"pickle.dumps((parent, block, extra), protocol=5) or cbor2.dumps(..., canonical=True),\n"
"with extra = (extra, *lookahead tokens) under lookahead. fast: as chain() writes a\n"
"block after its first (the extra keys copied in, the parent's identity not tracked:\n"
"the extra keys must not hold the parent object).");

static PyObject *serialise(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "serialise() takes 8 arguments");
        return NULL;
    }
    int fast = PyObject_IsTrue(args[7]);
    int serialisation = PyLong_AsLong(args[0]) == SER_CBOR ? SER_CBOR : SER_PICKLE;
    Py_ssize_t size = PyLong_AsSsize_t(args[2]), look = PyLong_AsSsize_t(args[3]);
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    PyObject *parent = args[5], *extra = args[6];
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!PyBytes_CheckExact(parent) || size <= 0 || look < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "serialise(): bad parent, block size or start");
        return NULL;
    }
    Tokens t;
    if (tokens_open(args[1], &t) != OK) {
        return NULL;
    }
    PyObject *result = NULL;
    Writer *w = NULL;
    if (start + size + look > t.n) {
        PyErr_SetString(PyExc_ValueError, "serialise(): block past the tokens");
    } else if ((w = writer_new()) != NULL) {
        Template template;
        int status = fast && serialisation == SER_PICKLE ? template_of(w, extra, &template)
                                                         : UNSUPPORTED;
        if (status != FAILED) {
            status = write_block(w, serialisation, PyBytes_AS_STRING(parent),
                                 PyBytes_GET_SIZE(parent), fast ? NULL : parent, &t, start, size,
                                 look, extra, status == OK ? &template : NULL);
        }
        result = status == FAILED        ? NULL
                 : status == UNSUPPORTED ? Py_NewRef(Py_None)
                                         : PyBytes_FromStringAndSize((char *)w->buf, w->len);
        writer_free(w);
    }
    tokens_close(&t);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, chain_doc},
    {"serialise", (PyCFunction)(void (*)(void))serialise, METH_FASTCALL, serialise_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain", "Compiled vLLM block-hash chain (pickle/CBOR + SHA-256).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
