/* kv_listener.core._wiretok: a msgpack array of token IDs straight into an array('I').
 *
 * Optional: setup.py builds it where a C compiler is there; core/decode_events.py's raw_tokens
 * uses it when it imports, and otherwise decodes the same bytes with msgspec and wire_tokens
 * (tests/test_decode_typed.py checks both on the same arrays).
 *
 * Why by hand: the current vLLM layout's token IDs are most of a stored block's bytes. Decoded
 * by msgspec they become a list of Python ints, which wire_tokens then copies into an
 * array('I') one item at a time (about 4.5k instructions for a 16-token block, with the list
 * and its ints freed after); core.wire leaves them undecoded (msgspec.Raw) and this reads
 * them once into the array's own buffer. No library decodes msgpack into a typed array.
 *
 * u32_array(raw) -> array('I') or None. None when the bytes are not exactly one msgpack array
 * whose items are all integers in 0 .. 2^32 - 1 (any encoding: fixint, uint 8..64, int 8..64
 * with a value in range): the caller then decodes them the general way, which keeps every
 * verdict (a negative or too large ID, a float, a pair) where it was.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define GIL_FREE_ITEMS 65536 /* a longer array is read with the GIL released */

static PyObject *one_zero; /* array('I', [0]): repeated to the size of each result */

static inline uint64_t
be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* Reads `n` items from p[0 .. len) into out; 0 when they are not all u32 ints or the bytes
 * do not end exactly with the last one */
static int
read_items(const unsigned char *p, Py_ssize_t len, Py_ssize_t n, uint32_t *out)
{
    const unsigned char *end = p + len;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p >= end) return 0;
        unsigned char b = *p++;
        uint64_t v;
        int size;
        if (b <= 0x7f) {
            out[i] = b;
            continue;
        }
        switch (b) {
        case 0xcc: case 0xd0: size = 1; break; /* uint8, int8 */
        case 0xcd: case 0xd1: size = 2; break;
        case 0xce: case 0xd2: size = 4; break;
        case 0xcf: case 0xd3: size = 8; break;
        default: return 0; /* negative fixint, nil, bool, float, str, ...: not a token ID */
        }
        if (end - p < size) return 0;
        v = be(p, size);
        p += size;
        if (b >= 0xd0 && (v >> (8 * size - 1)) & 1) return 0; /* a negative signed int */
        if (v > UINT32_MAX) return 0;
        out[i] = (uint32_t)v;
    }
    return p == end;
}

static PyObject *
u32_array(PyObject *Py_UNUSED(module), PyObject *raw)
{
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t len = view.len, n, head;
    PyObject *result = NULL;
    if (len >= 1 && (p[0] & 0xf0) == 0x90) {
        n = p[0] & 0x0f;
        head = 1;
    } else if (len >= 3 && p[0] == 0xdc) {
        n = (Py_ssize_t)be(p + 1, 2);
        head = 3;
    } else if (len >= 5 && p[0] == 0xdd) {
        n = (Py_ssize_t)be(p + 1, 4);
        head = 5;
    } else {
        goto none;
    }
    if (n > len - head) goto none; /* every item takes a byte at least: no bomb */
    result = PySequence_Repeat(one_zero, n);
    if (result == NULL) goto done;
    Py_buffer out;
    if (PyObject_GetBuffer(result, &out, PyBUF_WRITABLE) < 0) {
        Py_CLEAR(result);
        goto done;
    }
    int ok;
    if (n > GIL_FREE_ITEMS) {
        Py_BEGIN_ALLOW_THREADS
        ok = read_items(p + head, len - head, n, (uint32_t *)out.buf);
        Py_END_ALLOW_THREADS
    } else {
        ok = read_items(p + head, len - head, n, (uint32_t *)out.buf);
    }
    PyBuffer_Release(&out);
    if (ok) goto done;
    Py_CLEAR(result);
none:
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"u32_array", (PyCFunction)u32_array, METH_O,
     "u32_array(raw) -> array('I') of a msgpack array of u32 ints, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wiretok_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_wiretok",
    .m_methods = methods,
    .m_doc = "msgpack token IDs into array('I') in C (see core/decode_events.py's raw_tokens).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__wiretok(void)
{
    PyObject *array = PyImport_ImportModule("array");
    if (array == NULL) return NULL;
    one_zero = PyObject_CallMethod(array, "array", "s(i)", "I", 0);
    Py_DECREF(array);
    if (one_zero == NULL) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(one_zero, &b, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t itemsize = b.len;
    PyBuffer_Release(&b);
    if (itemsize != sizeof(uint32_t)) {
        PyErr_SetString(PyExc_ImportError, "array('I') items are not 4 bytes here");
        return NULL;
    }
    return PyModule_Create(&wiretok_module);
}
