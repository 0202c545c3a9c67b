/* kv_listener.core._saltmac: the cache salt check of core/salt.py (SPEC section 3) in one C call.
 *
 * Optional: setup.py builds it when a C compiler and OpenSSL's headers are there, and
 * core/salt.py's SaltVerifier uses it when it imports; otherwise SaltVerifier's own Python runs,
 * with the same verdicts (tests/test_salt_native.py checks both on the same salts).
 *
 * Why by hand: a salt is checked on every chain that starts (on a busy engine, most stored
 * blocks), and in Python the check costs about 13k instructions, 6k of them in CPython's
 * portable SHA-256 and most of the rest in the objects the steps make (the key's bytes, two
 * hash states, two digests, their hex text). No library offers HMAC from precomputed pad states
 * (Python's hmac and OpenSSL's HMAC() redo the pads each call), so this file keeps the two
 * SHA256_CTX states after the pads and copies them per salt (a struct copy, no allocation);
 * OpenSSL's SHA-256 compression uses the CPU's SHA extensions where it has them.
 *
 * Verdicts are exactly SaltVerifier._verify's: a str of 102 ASCII characters, "crs1:", 64
 * lowercase hex digits (the key), ":", then the first 16 bytes of
 * HMAC-SHA256(secret, "crs1" 0x00 backend 0x00 key) as 32 lowercase hex digits, compared in
 * constant time. Returns the key's 64 hex digits (a new str) or None.
 *
 * With `cache_size`, the verdicts of the last salts are kept in a table of that many slots
 * (rounded up to a power of two, 65 bytes each), indexed by the key: a salt seen again is
 * answered without the HMAC, and a new one costs one comparison (the Python path's dict of
 * salts cost more than the C HMAC on a stream of new salts). Bounded by construction.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_Init & co: the only API with copyable states */
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define PREFIX "crs1:"
#define PREFIX_LEN 5
#define KEY_BYTES 32
#define MAC_BYTES 16
#define KEY_END (PREFIX_LEN + 2 * KEY_BYTES)      /* index of the ':' before the MAC */
#define SALT_LENGTH (KEY_END + 1 + 2 * MAC_BYTES) /* 102 */
#define PAD_BYTES 64                              /* SHA-256's block: HMAC's key pad */

/* One remembered verdict: a salt is its key and its MAC text (the rest is fixed) */
typedef struct {
    unsigned char key[KEY_BYTES];
    unsigned char mac[2 * MAC_BYTES];
    unsigned char verdict; /* EMPTY, VALID or INVALID */
} Entry;

enum { EMPTY, VALID, INVALID };

typedef struct {
    PyObject_HEAD
    SHA256_CTX inner; /* after (key ^ ipad) and the message head "crs1" 0 backend 0 */
    SHA256_CTX outer; /* after (key ^ opad) */
    Entry *table;     /* the last verdicts, direct-mapped by key; NULL: none kept */
    size_t mask;      /* slots - 1 (a power of two) */
} Verifier;

static const char HEX[] = "0123456789abcdef";

/* a hex digit's value, -1 for anything else: uppercase too (the key's text must be its own
 * lowercase hex) */
static signed char HEX_VALUE[256];

static int
Verifier_init(Verifier *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"padded_secret", "head", "cache_size", NULL};
    Py_buffer key, head;
    Py_ssize_t cache_size = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*y*|n:Verifier", kwlist, &key, &head,
                                     &cache_size))
        return -1;
    int ok = key.len == PAD_BYTES && cache_size >= 0 && cache_size <= (1 << 24);
    if (ok && cache_size > 0) {
        size_t slots = 1;
        while (slots < (size_t)cache_size) slots <<= 1;
        Entry *table = PyMem_Calloc(slots, sizeof(Entry));
        if (table == NULL) {
            PyErr_NoMemory();
            ok = 0;
        } else {
            PyMem_Free(self->table);
            self->table = table;
            self->mask = slots - 1;
        }
    }
    if (ok) {
        unsigned char ipad[PAD_BYTES], opad[PAD_BYTES];
        const unsigned char *k = key.buf;
        for (int i = 0; i < PAD_BYTES; i++) {
            ipad[i] = k[i] ^ 0x36;
            opad[i] = k[i] ^ 0x5c;
        }
        ok = SHA256_Init(&self->inner) && SHA256_Update(&self->inner, ipad, PAD_BYTES)
             && SHA256_Update(&self->inner, head.buf, (size_t)head.len)
             && SHA256_Init(&self->outer) && SHA256_Update(&self->outer, opad, PAD_BYTES);
        if (!ok) PyErr_SetString(PyExc_RuntimeError, "SHA-256 setup failed");
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError,
                        "padded_secret must be 64 bytes and cache_size 0 .. 2**24");
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&head);
    return ok ? 0 : -1;
}

static PyObject *
Verifier_verify_hex(Verifier *self, PyObject *salt)
{
    if (!PyUnicode_Check(salt)) Py_RETURN_NONE;
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(salt) < 0) return NULL;
#endif
    if (PyUnicode_GET_LENGTH(salt) != SALT_LENGTH || !PyUnicode_IS_ASCII(salt)) Py_RETURN_NONE;
    const unsigned char *s = PyUnicode_1BYTE_DATA(salt);
    if (memcmp(s, PREFIX, PREFIX_LEN) != 0 || s[KEY_END] != ':') Py_RETURN_NONE;
    unsigned char key[KEY_BYTES];
    Entry *slot = NULL;
    for (int i = 0; i < KEY_BYTES; i++) {
        int hi = HEX_VALUE[s[PREFIX_LEN + 2 * i]], lo = HEX_VALUE[s[PREFIX_LEN + 2 * i + 1]];
        if (hi < 0 || lo < 0) Py_RETURN_NONE;
        key[i] = (unsigned char)(hi << 4 | lo);
        if (i == 7 && self->table != NULL) {
            /* keys are SHA-256 outputs: their first 8 bytes index evenly (a chosen key only
             * evicts). Fetched now, while the rest of the key is read: a new salt's slot is
             * a cache miss. */
            uint64_t h;
            memcpy(&h, key, sizeof h);
            slot = &self->table[h & self->mask];
            __builtin_prefetch(slot, 1);
        }
    }
    const unsigned char *mac = s + KEY_END + 1;
    if (slot != NULL) {
        /* a slot answers for exactly its key and MAC text */
        if (slot->verdict != EMPTY && memcmp(slot->key, key, KEY_BYTES) == 0) {
            unsigned char diff = 0; /* constant time: the slot may hold the true MAC */
            for (int i = 0; i < 2 * MAC_BYTES; i++) diff |= slot->mac[i] ^ mac[i];
            if (diff == 0) {
                if (slot->verdict == INVALID) Py_RETURN_NONE;
                return PyUnicode_Substring(salt, PREFIX_LEN, KEY_END);
            }
        }
    }
    SHA256_CTX inner = self->inner, outer = self->outer;
    unsigned char digest[SHA256_DIGEST_LENGTH];
    if (!SHA256_Update(&inner, key, KEY_BYTES) || !SHA256_Final(digest, &inner)
            || !SHA256_Update(&outer, digest, SHA256_DIGEST_LENGTH)
            || !SHA256_Final(digest, &outer)) {
        PyErr_SetString(PyExc_RuntimeError, "SHA-256 failed");
        return NULL;
    }
    /* constant time over the 32 digits, as hmac.compare_digest */
    unsigned char diff = 0;
    for (int i = 0; i < MAC_BYTES; i++) {
        diff |= (unsigned char)(mac[2 * i] ^ HEX[digest[i] >> 4]);
        diff |= (unsigned char)(mac[2 * i + 1] ^ HEX[digest[i] & 0x0f]);
    }
    if (slot != NULL) {
        memcpy(slot->key, key, KEY_BYTES);
        memcpy(slot->mac, mac, 2 * MAC_BYTES);
        slot->verdict = diff == 0 ? VALID : INVALID;
    }
    if (diff != 0) Py_RETURN_NONE;
    return PyUnicode_Substring(salt, PREFIX_LEN, KEY_END);
}

static void
Verifier_dealloc(Verifier *self)
{
    PyMem_Free(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Verifier_cache_bytes(Verifier *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->table == NULL ? 0 : (self->mask + 1) * sizeof(Entry));
}

static PyGetSetDef Verifier_getset[] = {
    {"cache_bytes", (getter)Verifier_cache_bytes, NULL, "bytes the verdict table takes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Verifier_methods[] = {
    {"verify_hex", (PyCFunction)Verifier_verify_hex, METH_O,
     "verify_hex(salt) -> the key's 64 lowercase hex digits, or None for an invalid salt"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef saltmac_module = {
    PyModuleDef_HEAD_INIT,
    .m_size = -1,
    .m_name = "_saltmac",
    .m_doc = "Cache salt verification in C (see core/salt.py's SaltVerifier).",
};

static PyTypeObject VerifierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kv_listener.core._saltmac.Verifier",
    .tp_basicsize = sizeof(Verifier),
    .tp_doc = "Verifier(padded_secret: 64 bytes, head: bytes, cache_size: int = 0): HMAC-SHA256 "
              "salt checks of one secret and backend, the last verdicts remembered",
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = Verifier_methods,
    .tp_getset = Verifier_getset,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Verifier_init,
    .tp_dealloc = (destructor)Verifier_dealloc,
};


PyMODINIT_FUNC
PyInit__saltmac(void)
{
    for (int c = 0; c < 256; c++)
        HEX_VALUE[c] = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    PyObject *m = PyModule_Create(&saltmac_module);
    if (m != NULL && PyModule_AddType(m, &VerifierType) < 0) Py_CLEAR(m);
    return m;
}
