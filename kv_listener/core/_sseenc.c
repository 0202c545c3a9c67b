/* kv_listener.core._sseenc: core/sse.py's encode_record_list in C, for the records of the common
 * kinds; every other record goes through the Python encode_record it is given.
 *
 * Optional: setup.py builds it where a C compiler is there, and core/sse.py uses it when it
 * imports; otherwise encode_record_list's Python runs, with the same bytes
 * (tests/test_sse_native.py checks both on the same records).
 *
 * Why by hand: two records per stored block on a busy engine, and compiled by mypyc the
 * encoder still spends about 4.7k instructions on each: seven generic reads of a msgspec
 * Struct's fields, the prefix check through str and bytes methods, an f-string and its UTF-8
 * copy. Here the fields are read at the offsets of the Struct's member descriptors, the
 * prefix checked by table, and the bytes written once. No library writes an SSE record.
 *
 * The bytes, as core/sse.py's encode_record_list writes them (SPEC section 6):
 *   cache_cleared:                  id: <id><head><tail>
 *   cache_created, cache_offloaded: id: <id><head>,"prefix_hash":"<p>","token_count":<n>,
 *                                   "tier":"<tier>"<tail>
 *   any other event:                id: <id><head>,"prefix_hash":"<p>"<tail>
 * where <head> is `head_of(event, backend)` and <tail> is `tail_of(ts)` (Python helpers of
 * core/sse.py, called once per distinct value in a list). A record goes to `fallback` (the
 * Python encode_record) when it is not exactly a Record, its id is not ASCII text, its ts not
 * a finite float, its event not a RecordEvent, its prefix not ASCII letters and digits, or
 * (created, offloaded) its count not an int or its tier not in `tier_text`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <string.h>

enum { F_ID, F_EVENT, F_BACKEND, F_PREFIX, F_COUNT, F_TIER, F_TS, N_FIELDS };
static const char *FIELD_NAMES[N_FIELDS] = {
    "id", "event", "backend", "prefix_hash", "token_count", "tier", "ts",
};

#define HEADS 8 /* (event, backend) pairs remembered per call: a few backends per process */
#define TAILS 4 /* distinct ts per call: one publish has one */

/* the objects an Encoder holds, in the order of its constructor's arguments */
enum { R_RECORD_TYPE, R_EVENT_TYPE, R_CLEARED, R_CREATED, R_OFFLOADED, R_TIER_TEXT, R_HEAD_OF,
       R_TAIL_OF, R_FALLBACK, N_REFS };

typedef struct {
    PyObject_HEAD
    PyObject *ref[N_REFS]; /* record and event types, RecordEvent members, tier texts, helpers */
    Py_ssize_t offset[N_FIELDS];
} Encoder;

typedef struct {
    PyObject *event, *backend, *head; /* head: a new reference to an ASCII str */
} Head;

typedef struct {
    double ts;
    PyObject *tail; /* a new reference: an ASCII str, or Py_None */
} Tail;

/* ASCII letters and digits: what a prefix hash may hold unescaped in JSON */
static unsigned char ALNUM[256];

static int
Encoder_init(Encoder *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"record_type", "event_type", "cleared", "created", "offloaded",
                             "tier_text", "head_of", "tail_of", "fallback", NULL};
    PyObject *record_type, *event_type, *cleared, *created, *offloaded, *tier_text, *head_of,
             *tail_of, *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OOOO!OOO:Encoder", kwlist,
                                     &PyType_Type, &record_type, &PyType_Type, &event_type,
                                     &cleared, &created, &offloaded, &PyDict_Type, &tier_text,
                                     &head_of, &tail_of, &fallback))
        return -1;
    Py_ssize_t offset[N_FIELDS];
    for (int i = 0; i < N_FIELDS; i++) {
        /* a msgspec Struct's fields are member descriptors of object slots */
        PyObject *d = PyDict_GetItemString(((PyTypeObject *)record_type)->tp_dict, FIELD_NAMES[i]);
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)
                || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "record_type has no object slot named %s",
                         FIELD_NAMES[i]);
            return -1;
        }
        offset[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    memcpy(self->offset, offset, sizeof(offset));
    PyObject *refs[N_REFS] = {record_type, event_type, cleared, created, offloaded, tier_text,
                              head_of, tail_of, fallback};
    for (int i = 0; i < N_REFS; i++) {
        Py_INCREF(refs[i]);
        Py_XSETREF(self->ref[i], refs[i]);
    }
    return 0;
}

static int
Encoder_traverse(Encoder *self, visitproc visit, void *arg)
{
    for (int i = 0; i < N_REFS; i++) Py_VISIT(self->ref[i]);
    return 0;
}

static int
Encoder_clear(Encoder *self)
{
    for (int i = 0; i < N_REFS; i++) Py_CLEAR(self->ref[i]);
    return 0;
}

static void
Encoder_dealloc(Encoder *self)
{
    PyObject_GC_UnTrack(self);
    Encoder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An ASCII str's bytes and length, or NULL when `s` is not an exact ASCII str */
static const char *
ascii_of(PyObject *s, Py_ssize_t *len)
{
    if (!PyUnicode_CheckExact(s))
        return NULL;
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) < 0) {
        PyErr_Clear();
        return NULL;
    }
#endif
    if (!PyUnicode_IS_ASCII(s))
        return NULL;
    *len = PyUnicode_GET_LENGTH(s);
    return (const char *)PyUnicode_1BYTE_DATA(s);
}

/* The record's bytes, or Py_None (a new reference) when it is not of the kinds above, or
 * NULL on an error raised by a helper */
static PyObject *
encode_one(Encoder *self, PyObject *r, Head *heads, int *n_heads, Tail *tails, int *n_tails)
{
    if (Py_TYPE(r) != (PyTypeObject *)self->ref[R_RECORD_TYPE])
        Py_RETURN_NONE;
    PyObject *f[N_FIELDS];
    for (int i = 0; i < N_FIELDS; i++) {
        f[i] = *(PyObject **)((char *)r + self->offset[i]);
        if (f[i] == NULL)
            Py_RETURN_NONE;
    }
    PyObject *event = f[F_EVENT];
    Py_ssize_t id_len, head_len, tail_len, prefix_len = 0, tier_len = 0;
    const char *id = ascii_of(f[F_ID], &id_len);
    if (id == NULL || !PyFloat_CheckExact(f[F_TS])
            || Py_TYPE(event) != (PyTypeObject *)self->ref[R_EVENT_TYPE])
        Py_RETURN_NONE;
    double ts = PyFloat_AS_DOUBLE(f[F_TS]);
    if (!isfinite(ts))
        Py_RETURN_NONE;
    PyObject *tail = NULL;
    for (int i = 0; i < *n_tails; i++) {
        if (memcmp(&tails[i].ts, &ts, sizeof ts) == 0) {
            tail = tails[i].tail;
            break;
        }
    }
    if (tail == NULL) {
        if (*n_tails >= TAILS)
            Py_RETURN_NONE; /* more distinct ts in one list than remembered: Python's way */
        tail = PyObject_CallOneArg(self->ref[R_TAIL_OF], f[F_TS]);
        if (tail == NULL)
            return NULL;
        tails[*n_tails].ts = ts;
        tails[(*n_tails)++].tail = tail; /* the cache holds the reference */
    }
    const char *tail_s = tail == Py_None ? NULL : ascii_of(tail, &tail_len);
    if (tail_s == NULL)
        Py_RETURN_NONE;
    PyObject *head = NULL;
    for (int i = 0; i < *n_heads; i++) {
        if (heads[i].event == event && heads[i].backend == f[F_BACKEND]) {
            head = heads[i].head;
            break;
        }
    }
    if (head == NULL) {
        if (*n_heads >= HEADS)
            Py_RETURN_NONE;
        head = PyObject_CallFunctionObjArgs(self->ref[R_HEAD_OF], event, f[F_BACKEND], NULL);
        if (head == NULL)
            return NULL;
        heads[*n_heads].event = event;
        heads[*n_heads].backend = f[F_BACKEND];
        heads[(*n_heads)++].head = head; /* the cache holds the reference */
    }
    const char *head_s = ascii_of(head, &head_len);
    if (head_s == NULL)
        Py_RETURN_NONE;
    const char *prefix = NULL, *tier = NULL;
    char count[24];
    int count_len = 0;
    if (event != self->ref[R_CLEARED]) {
        prefix = ascii_of(f[F_PREFIX], &prefix_len);
        if (prefix == NULL)
            Py_RETURN_NONE;
        for (Py_ssize_t i = 0; i < prefix_len; i++) {
            if (!ALNUM[(unsigned char)prefix[i]])
                Py_RETURN_NONE;
        }
        if (prefix_len == 0)
            Py_RETURN_NONE; /* "".isalnum() is False */
        if (event == self->ref[R_CREATED] || event == self->ref[R_OFFLOADED]) {
            if (!PyLong_CheckExact(f[F_COUNT]))
                Py_RETURN_NONE;
            int overflow;
            long long n = PyLong_AsLongLongAndOverflow(f[F_COUNT], &overflow);
            if (overflow || (n == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                Py_RETURN_NONE;
            }
            count_len = snprintf(count, sizeof count, "%lld", n);
            PyObject *t = PyDict_GetItemWithError(self->ref[R_TIER_TEXT], f[F_TIER]);
            if (t == NULL) {
                if (PyErr_Occurred())
                    return NULL;
                Py_RETURN_NONE;
            }
            tier = ascii_of(t, &tier_len);
            if (tier == NULL)
                Py_RETURN_NONE;
        }
    }
    static const char ID[] = "id: ", P0[] = ",\"prefix_hash\":\"", P1[] = "\"",
                      C0[] = "\",\"token_count\":", T0[] = ",\"tier\":\"";
#define LIT(s) (Py_ssize_t)(sizeof(s) - 1)
    Py_ssize_t size = LIT(ID) + id_len + head_len + tail_len;
    if (prefix != NULL) {
        size += LIT(P0) + prefix_len;
        size += tier != NULL ? LIT(C0) + count_len + LIT(T0) + tier_len + LIT(P1) : LIT(P1);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
#define PUT(s, n) (memcpy(p, (s), (size_t)(n)), p += (n))
    PUT(ID, LIT(ID));
    PUT(id, id_len);
    PUT(head_s, head_len);
    if (prefix != NULL) {
        PUT(P0, LIT(P0));
        PUT(prefix, prefix_len);
        if (tier != NULL) {
            PUT(C0, LIT(C0));
            PUT(count, count_len);
            PUT(T0, LIT(T0));
            PUT(tier, tier_len);
        }
        PUT(P1, LIT(P1));
    }
    PUT(tail_s, tail_len);
#undef PUT
#undef LIT
    return out;
}

static PyObject *
Encoder_encode_list(Encoder *self, PyObject *records)
{
    PyObject *seq = PySequence_Fast(records, "records must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    Head heads[HEADS];
    Tail tails[TAILS];
    int n_heads = 0, n_tails = 0;
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = encode_one(self, items[i], heads, &n_heads, tails, &n_tails);
        if (b == Py_None) {
            Py_DECREF(b);
            b = PyObject_CallOneArg(self->ref[R_FALLBACK], items[i]);
        }
        if (b == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, b);
    }
done:
    for (int i = 0; i < n_heads; i++)
        Py_DECREF(heads[i].head);
    for (int i = 0; i < n_tails; i++)
        Py_DECREF(tails[i].tail);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef Encoder_methods[] = {
    {"encode_list", (PyCFunction)Encoder_encode_list, METH_O,
     "encode_list(records) -> [bytes of each record's SSE event], as encode_record_list"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kv_listener.core._sseenc.Encoder",
    .tp_doc = "Encoder(record_type, event_type, cleared, created, offloaded, tier_text, head_of, "
              "tail_of, fallback): core/sse.py's encode_record_list in C",
    .tp_basicsize = sizeof(Encoder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Encoder_init,
    .tp_dealloc = (destructor)Encoder_dealloc,
    .tp_traverse = (traverseproc)Encoder_traverse,
    .tp_clear = (inquiry)Encoder_clear,
    .tp_methods = Encoder_methods,
};

static struct PyModuleDef sseenc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_sseenc",
    .m_doc = "SSE record encoding in C (see core/sse.py's encode_record_list).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__sseenc(void)
{
    for (int c = 0; c < 256; c++)
        ALNUM[c] = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    PyObject *m = PyModule_Create(&sseenc_module);
    if (m != NULL && PyModule_AddType(m, &EncoderType) < 0) Py_CLEAR(m);
    return m;
}
