/* speckv.hashing._chainhash: the optional native block-hash chain.
 *
 * Owns one function, `chain_hash_blocks`, which hashes a run of extra-key-free blocks of a
 * token list exactly as `digest(pickle.dumps((parent, tuple(block), tail), protocol=5))`
 * chains them, without building any Python tuple:
 *
 *     message = PROTO 5 | FRAME len | SHORT_BINBYTES len(parent) | parent | piece
 *     piece   = prefix | block tokens | mid | lookahead tokens | suffix
 *
 * where `prefix`, `mid` and `suffix` are the format's constant pickle bytes (see
 * speckv/hashing/formats.py and pickle_fast.py) and each token id is written as CPython's
 * pickler writes a plain int in [0, 2**31): BININT1 `K`, BININT2 `M` or BININT `J`.
 * Anything else (an int subclass such as bool, a negative or >= 2**31 id, a non-int) raises
 * OverflowError before its block is hashed, so the caller can hash that block the plain way.
 *
 * The digest is any Python callable: `hashlib.sha256` (then `.digest()` is called on its
 * result, `call_digest` true) or a bytes -> bytes function such as `xxhash.xxh3_128_digest`.
 * Hashes are appended to `out` as they are made: after an error `out` holds a correct prefix.
 * The pure-Python/numpy path in pickle_fast.py computes the same bytes; tests compare both
 * with `pickle.dumps`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_PARENT_BYTES 255
#define HEAD_BYTES 13 /* PROTO(2) FRAME(1 + 8) SHORT_BINBYTES(1) len(1) */

static PyObject *str_digest;

/* Write token `obj` at `out`; returns bytes written, or -1 (OverflowError set). */
static inline Py_ssize_t put_token(PyObject *obj, unsigned char *out) {
    if (!PyLong_CheckExact(obj)) {
        PyErr_SetString(PyExc_OverflowError, "token id is not a plain int");
        return -1;
    }
    int overflow = 0;
    long value = PyLong_AsLongAndOverflow(obj, &overflow);
    if (overflow || value < 0 || value >= 2147483648L) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_OverflowError, "token id outside [0, 2**31)");
        }
        return -1;
    }
    unsigned long v = (unsigned long)value;
    if (v < 256) {
        out[0] = 'K';
        out[1] = (unsigned char)v;
        return 2;
    }
    if (v < 65536) {
        out[0] = 'M';
        out[1] = (unsigned char)(v & 0xff);
        out[2] = (unsigned char)(v >> 8);
        return 3;
    }
    out[0] = 'J';
    out[1] = (unsigned char)(v & 0xff);
    out[2] = (unsigned char)((v >> 8) & 0xff);
    out[3] = (unsigned char)((v >> 16) & 0xff);
    out[4] = (unsigned char)(v >> 24);
    return 5;
}

static int as_bytes(PyObject *obj, const char *name, const char **data, Py_ssize_t *size) {
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes", name);
        return -1;
    }
    *data = PyBytes_AS_STRING(obj);
    *size = PyBytes_GET_SIZE(obj);
    return 0;
}

/* chain_hash_blocks(token_ids, start, num_blocks, block_size, lookahead, prefix, mid, suffix,
 *                   parent, digest, call_digest, out) -> last hash (or parent) */
static PyObject *chain_hash_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "chain_hash_blocks takes 12 arguments");
        return NULL;
    }
    PyObject *tokens = args[0];
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        PyErr_SetString(PyExc_TypeError, "token_ids must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t num_blocks = PyLong_AsSsize_t(args[2]);
    Py_ssize_t block_size = PyLong_AsSsize_t(args[3]);
    Py_ssize_t lookahead = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    const char *prefix, *mid, *suffix;
    Py_ssize_t prefix_len, mid_len, suffix_len;
    if (as_bytes(args[5], "prefix", &prefix, &prefix_len) < 0 ||
        as_bytes(args[6], "mid", &mid, &mid_len) < 0 ||
        as_bytes(args[7], "suffix", &suffix, &suffix_len) < 0) {
        return NULL;
    }
    PyObject *parent = args[8];
    PyObject *digest = args[9];
    int call_digest = PyObject_IsTrue(args[10]);
    PyObject *out = args[11];
    if (call_digest < 0) {
        return NULL;
    }
    if (!PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "out must be a list");
        return NULL;
    }
    if (start < 0 || num_blocks < 0 || block_size <= 0 || lookahead < 0) {
        PyErr_SetString(PyExc_ValueError, "start, num_blocks, lookahead >= 0, block_size > 0");
        return NULL;
    }
    Py_ssize_t num_tokens = PySequence_Fast_GET_SIZE(tokens);
    if (num_blocks > 0 &&
        (num_blocks > (PY_SSIZE_T_MAX - start - lookahead) / block_size ||
         start + num_blocks * block_size + lookahead > num_tokens)) {
        PyErr_SetString(PyExc_ValueError, "token_ids is too short for these blocks");
        return NULL;
    }
    if (!PyBytes_Check(parent) || PyBytes_GET_SIZE(parent) > MAX_PARENT_BYTES) {
        PyErr_SetString(PyExc_ValueError, "parent must be bytes shorter than 256");
        return NULL;
    }
    /* pickle's 64 KiB frame target: larger payloads are framed differently */
    Py_ssize_t max_message = HEAD_BYTES + MAX_PARENT_BYTES + prefix_len + mid_len + suffix_len +
                             5 * (block_size + lookahead);
    if (max_message - HEAD_BYTES > 60000) {
        PyErr_SetString(PyExc_ValueError, "blocks too large for one pickle frame");
        return NULL;
    }
    unsigned char *buf = PyMem_Malloc((size_t)max_message);
    if (buf == NULL) {
        return PyErr_NoMemory();
    }
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    Py_INCREF(parent);
    for (Py_ssize_t block = 0; block < num_blocks; block++) {
        Py_ssize_t parent_len = PyBytes_GET_SIZE(parent);
        Py_ssize_t first = start + block * block_size;
        /* re-read: a digest written in Python could have changed the list */
        if (first + block_size + lookahead > PySequence_Fast_GET_SIZE(tokens)) {
            PyErr_SetString(PyExc_ValueError, "token_ids shrank while hashing");
            goto error;
        }
        items = PySequence_Fast_ITEMS(tokens);
        unsigned char *p = buf + HEAD_BYTES + parent_len;
        memcpy(p, prefix, (size_t)prefix_len);
        p += prefix_len;
        for (Py_ssize_t i = first; i < first + block_size; i++) {
            Py_ssize_t n = put_token(items[i], p);
            if (n < 0) {
                goto error;
            }
            p += n;
        }
        memcpy(p, mid, (size_t)mid_len);
        p += mid_len;
        for (Py_ssize_t i = first + block_size; i < first + block_size + lookahead; i++) {
            Py_ssize_t n = put_token(items[i], p);
            if (n < 0) {
                goto error;
            }
            p += n;
        }
        memcpy(p, suffix, (size_t)suffix_len);
        p += suffix_len;
        Py_ssize_t total = p - buf;
        unsigned long long frame = (unsigned long long)(total - 11); /* after FRAME's 9 bytes */
        buf[0] = 0x80;
        buf[1] = 5;
        buf[2] = 0x95;
        for (int k = 0; k < 8; k++) {
            buf[3 + k] = (unsigned char)(frame >> (8 * k));
        }
        buf[11] = 'C';
        buf[12] = (unsigned char)parent_len;
        memcpy(buf + HEAD_BYTES, PyBytes_AS_STRING(parent), (size_t)parent_len);

        PyObject *message = PyBytes_FromStringAndSize((const char *)buf, total);
        if (message == NULL) {
            goto error;
        }
        PyObject *hashed = PyObject_CallOneArg(digest, message);
        Py_DECREF(message);
        if (hashed == NULL) {
            goto error;
        }
        if (call_digest) {
            PyObject *value = PyObject_CallMethodNoArgs(hashed, str_digest);
            Py_DECREF(hashed);
            if (value == NULL) {
                goto error;
            }
            hashed = value;
        }
        if (!PyBytes_CheckExact(hashed) || PyBytes_GET_SIZE(hashed) > MAX_PARENT_BYTES) {
            Py_DECREF(hashed);
            PyErr_SetString(PyExc_TypeError, "the digest must return bytes shorter than 256");
            goto error;
        }
        if (PyList_Append(out, hashed) < 0) {
            Py_DECREF(hashed);
            goto error;
        }
        Py_SETREF(parent, hashed);
    }
    PyMem_Free(buf);
    return parent;

error:
    PyMem_Free(buf);
    Py_DECREF(parent);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_hash_blocks", (PyCFunction)(void (*)(void))chain_hash_blocks, METH_FASTCALL,
     "chain_hash_blocks(token_ids, start, num_blocks, block_size, lookahead, prefix, mid, "
     "suffix, parent, digest, call_digest, out) -> last hash\n\n"
     "Append the chained hashes of blocks start + j * block_size (j < num_blocks) to out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chainhash",
    "Native chained block hashing (optional; see chain_hash_blocks).", -1, methods,
};

PyMODINIT_FUNC PyInit__chainhash(void) {
    str_digest = PyUnicode_InternFromString("digest");
    if (str_digest == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
