/* One lookup's round trip on a plain socket, releasing the GIL once
 * (indexer/redis/_redis_lookup.c's socket half; one translation unit).
 *
 * Why not socket.sendall + recv_into: each of those syscalls releases and retakes the
 * GIL (sendall once, recv_into twice: its poll, then the read), and on a replica
 * whose event loop and eight index threads all want the GIL, each retake can wait on
 * the GIL's futex and switch threads. Here the send and every read are tried without
 * blocking while the GIL is held (a lookup's ~8 KB goes out at once on loopback), and
 * the GIL is released only around poll() while Redis works: one handoff per wait.
 */
#ifndef KVINDEX_REDIS_IO_H
#define KVINDEX_REDIS_IO_H

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

/* Wait until fd is ready for ``events`` without the GIL: 1 ready, 0 timed out, -1 with
 * an exception set. ``timeout_ms`` < 0 waits for ever. */
static int wait_fd(long fd, short events, int timeout_ms) {
    struct pollfd p = {(int)fd, events, 0};
    int got, saved;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        got = poll(&p, 1, timeout_ms);
        saved = errno;
        Py_END_ALLOW_THREADS
        if (got >= 0) {
            return got > 0;
        }
        if (saved != EINTR) {
            errno = saved;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0) {
            return -1;
        }
    }
}

PyDoc_STRVAR(exchange_doc,
"exchange(fd, payload, buffer, count, timeout) -> int\n\n"
"Send ``payload`` on the connected socket ``fd`` and read into the bytearray ``buffer``\n"
"(grown when full) until ``count`` whole replies are there; where they end.\n"
"``timeout``: seconds any one wait may take (None: no limit). TimeoutError past it,\n"
"ConnectionError when Redis closes the connection, OSError for other socket errors,\n"
"ValueError for an answer that is not RESP.");

static PyObject *exchange(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyBytes_Check(args[1]) || !PyByteArray_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "exchange(fd, payload: bytes, buffer: bytearray, count, timeout)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if ((fd == -1 || count == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    int timeout_ms = -1;
    if (args[4] != Py_None) {
        double seconds = PyFloat_AsDouble(args[4]);
        if (seconds == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
        timeout_ms = seconds <= 0 ? 0 : seconds > 2e6 ? 2000000000 : (int)(seconds * 1000 + 0.5);
    }
    PyObject *buffer = args[2];
    const char *out = PyBytes_AS_STRING(args[1]);
    Py_ssize_t left = PyBytes_GET_SIZE(args[1]);
    while (left > 0) {
        ssize_t sent = send((int)fd, out, (size_t)left, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent >= 0) {
            out += sent;
            left -= sent;
            continue;
        }
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0) {
                return NULL;
            }
            continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        int ready = wait_fd(fd, POLLOUT, timeout_ms);
        if (ready <= 0) {
            return ready < 0 ? NULL : (PyErr_SetString(PyExc_TimeoutError, "timed out"), NULL);
        }
    }
    Py_ssize_t got = 0;
    for (;;) {
        Py_ssize_t size = PyByteArray_GET_SIZE(buffer);
        if (got == size && PyByteArray_Resize(buffer, size ? 2 * size : 65536) < 0) {
            return NULL;
        }
        size = PyByteArray_GET_SIZE(buffer);
        char *data = PyByteArray_AS_STRING(buffer);
        ssize_t read = recv((int)fd, data + got, (size_t)(size - got), MSG_DONTWAIT);
        if (read == 0) {
            PyErr_SetString(PyExc_ConnectionError, "Redis closed the connection");
            return NULL;
        }
        if (read < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) {
                    return NULL;
                }
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            int ready = wait_fd(fd, POLLIN, timeout_ms);
            if (ready <= 0) {
                return ready < 0 ? NULL
                                 : (PyErr_SetString(PyExc_TimeoutError, "timed out"), NULL);
            }
            continue;
        }
        got += read;
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; i < count && at >= 0; i++) {
            at = resp_skip(PyByteArray_AS_STRING(buffer), at, got, 0);
        }
        if (at == RESP_BAD) {
            PyErr_SetString(PyExc_ValueError, "the reply is not RESP");
            return NULL;
        }
        if (at >= 0) {
            if (at != got) {
                PyErr_SetString(PyExc_ValueError, "Redis sent more than the replies asked for");
                return NULL;
            }
            return PyLong_FromSsize_t(at);
        }
    }
}

#endif
