/* A packed row's int64 tensors from its stored columns, in one call: what packer.training.decode does
 * with numpy, which gives the same values and is the reference the tests compare this with.
 *
 * Why C: numpy needs one call per column and has no fused select-by-bitmap, so a format-2 row (the
 * loss as a bit mask) cost more to decode than a format-1 row (int32 labels), and every row paid ~5
 * numpy calls of overhead (benchmarks/bench_loader.py). Here a row is one call; its work is widening
 * copies and a select that copies or fills whole 64-bit words and bytes of the mask at once (a loss
 * mask is runs).
 *
 * Memory safety does not rest on the caller: every buffer's type and length is checked against the
 * offsets before anything is read or written, an output that shares a byte with any other buffer (an
 * input or another output) is refused (the copies below take their buffers as disjoint: restrict,
 * memcpy), every write is bounded by its buffer's checked length, and a bad argument raises ValueError
 * or TypeError. tests/fuzz_kernel.py fuzzes it under AddressSanitizer and UBSan (.ci/run runs it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define IGNORE_INDEX (-100)

/* The element type of a buffer, from its struct format: 'H' uint16, 'I' uint32, 'i' int32, 'q'
 * int64 ('l' where long is 8 bytes), 'B' uint8; 0 for anything else (a byte order not native too). */
static char kind(const Py_buffer *b) {
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN)) f++;
    if (f[0] == 0 || f[1] != 0) return 0;
    switch (f[0]) {
    case 'H': return b->itemsize == 2 ? 'H' : 0;
    case 'I': return b->itemsize == 4 ? 'I' : 0;
    case 'i': return b->itemsize == 4 ? 'i' : 0;
    case 'l': case 'q': return b->itemsize == 8 ? 'q' : 0;
    case 'B': return b->itemsize == 1 ? 'B' : 0;
    }
    return 0;
}

static Py_ssize_t count(const Py_buffer *b) { return b->itemsize ? b->len / b->itemsize : 0; }

/* dst[i] = src[lo + i] for i < n, widened to int64 */
static void widen(const Py_buffer *src, Py_ssize_t lo, Py_ssize_t n, int64_t *restrict dst) {
    switch (kind(src)) {
    case 'H': { const uint16_t *restrict s = (const uint16_t *)src->buf + lo; for (Py_ssize_t i = 0; i < n; i++) dst[i] = s[i]; break; }
    case 'I': { const uint32_t *restrict s = (const uint32_t *)src->buf + lo; for (Py_ssize_t i = 0; i < n; i++) dst[i] = s[i]; break; }
    case 'i': { const int32_t *restrict s = (const int32_t *)src->buf + lo; for (Py_ssize_t i = 0; i < n; i++) dst[i] = s[i]; break; }
    }
}

static inline int64_t pick(unsigned bit, int64_t id) { return bit ? id : IGNORE_INDEX; }

/* out[i] = ids[i] where bit (start + i) of ``bits`` is set (least significant first, as Arrow packs
 * booleans), else IGNORE_INDEX. A loss mask is runs: 64 bits all set or all clear (a word of the
 * bitmap) are one copy or one fill, as are whole bytes; only a byte where a run ends goes bit by bit. */
static inline void select_byte(uint8_t v, const int64_t *restrict ids, int64_t *restrict out) {
    if (v == 0xFF) memcpy(out, ids, 8 * sizeof(int64_t));
    else if (v == 0) for (int k = 0; k < 8; k++) out[k] = IGNORE_INDEX;
    else for (int k = 0; k < 8; k++) out[k] = pick((v >> k) & 1, ids[k]);
}

static void select_bits(const uint8_t *bits, Py_ssize_t start, Py_ssize_t n, const int64_t *restrict ids,
                        int64_t *restrict out) {
    Py_ssize_t i = 0;
    for (; i < n && ((start + i) & 7); i++) out[i] = pick((bits[(start + i) >> 3] >> ((start + i) & 7)) & 1, ids[i]);
    const uint8_t *p = bits + ((start + i) >> 3);
    for (; i + 8 <= n && ((start + i) & 63); i += 8, p++) select_byte(*p, ids + i, out + i);
    for (; i + 64 <= n; i += 64, p += 8) {
        uint64_t w;
        memcpy(&w, p, sizeof w);  /* the bitmap's bytes in order: little-endian, as Arrow's bits are */
        if (w == ~(uint64_t)0) memcpy(out + i, ids + i, 64 * sizeof(int64_t));
        else if (w == 0) for (int k = 0; k < 64; k++) out[i + k] = IGNORE_INDEX;
        else for (int b = 0; b < 8; b++) select_byte(p[b], ids + i + 8 * b, out + i + 8 * b);
    }
    for (; i + 8 <= n; i += 8, p++) select_byte(*p, ids + i, out + i);
    for (Py_ssize_t k = 0; i < n; i++, k++) out[i] = pick((*p >> k) & 1, ids[i]);
}

enum { IDS, POS, LABELS, SEGS, OUT_IDS, OUT_POS, OUT_LABELS, SEQ_IDX, CU, NBUF };

static const char *const NAMES[NBUF] = {"ids", "positions", "labels", "seq_lens", "out_ids", "out_positions",
                                        "out_labels", "seq_idx", "cu_seq_lens"};

static int fail(PyObject *type, const char *message, int which) {
    PyErr_Format(type, "decode: %s %s", NAMES[which], message);
    return -1;
}

/* Checks every buffer against the offsets; 0 when all is in bounds. */
static int check(Py_buffer *b, int have_labels, Py_ssize_t bit_start, Py_ssize_t o0, Py_ssize_t o1,
                 Py_ssize_t s0, Py_ssize_t s1) {
    for (int w = IDS; w <= POS; w++) {
        char k = kind(&b[w]);
        if (k != 'H' && k != 'I' && k != 'i') return fail(PyExc_TypeError, "must be uint16, uint32 or int32", w);
        if (count(&b[w]) < o1) return fail(PyExc_ValueError, "is shorter than the row's end", w);
    }
    if (have_labels) {
        if (bit_start < 0) {
            if (kind(&b[LABELS]) != 'i') return fail(PyExc_TypeError, "must be int32 (or a uint8 bitmap with bit_start >= 0)", LABELS);
            if (count(&b[LABELS]) < o1) return fail(PyExc_ValueError, "is shorter than the row's end", LABELS);
        } else {
            if (kind(&b[LABELS]) != 'B') return fail(PyExc_TypeError, "bitmap must be uint8", LABELS);
            if (bit_start > PY_SSIZE_T_MAX - o1 - 7 || count(&b[LABELS]) < (bit_start + o1 + 7) / 8)
                return fail(PyExc_ValueError, "bitmap is shorter than the row's end", LABELS);
        }
    }
    if (kind(&b[SEGS]) != 'i') return fail(PyExc_TypeError, "must be int32", SEGS);
    if (count(&b[SEGS]) < s1) return fail(PyExc_ValueError, "is shorter than the row's last segment", SEGS);
    for (int w = OUT_IDS; w <= OUT_LABELS; w++) {
        if (kind(&b[w]) != 'q') return fail(PyExc_TypeError, "must be int64", w);
        if (count(&b[w]) != o1 - o0) return fail(PyExc_ValueError, "must hold the row's tokens", w);
    }
    if (kind(&b[SEQ_IDX]) != 'i') return fail(PyExc_TypeError, "must be int32", SEQ_IDX);
    if (count(&b[SEQ_IDX]) != o1 - o0) return fail(PyExc_ValueError, "must hold the row's tokens", SEQ_IDX);
    if (kind(&b[CU]) != 'i') return fail(PyExc_TypeError, "must be int32", CU);
    if (count(&b[CU]) != s1 - s0 + 1) return fail(PyExc_ValueError, "must hold one more than the row's segments", CU);
    /* every output's bytes its own: none shares a byte with any other buffer given (an absent labels
     * buffer has none); compared as integers, as pointers into unrelated objects cannot be */
    for (int w = OUT_IDS; w < NBUF; w++) {
        const uintptr_t lo = (uintptr_t)b[w].buf, hi = lo + (uintptr_t)b[w].len;
        for (int v = 0; v < NBUF; v++) {
            if (v == w || b[v].len <= 0 || b[w].len <= 0) continue;
            const uintptr_t vlo = (uintptr_t)b[v].buf, vhi = vlo + (uintptr_t)b[v].len;
            if (lo < vhi && vlo < hi) {
                PyErr_Format(PyExc_ValueError, "decode: %s overlaps %s; every output needs memory of its own",
                             NAMES[w], NAMES[v]);
                return -1;
            }
        }
    }
    const int32_t *seg = (const int32_t *)b[SEGS].buf + s0;
    Py_ssize_t total = 0;
    for (Py_ssize_t s = 0; s < s1 - s0; s++) {
        if (seg[s] < 0) return fail(PyExc_ValueError, "has a negative length", SEGS);
        total += seg[s];
    }
    if (total != o1 - o0) return fail(PyExc_ValueError, "do not sum to the row's tokens", SEGS);
    return 0;
}

PyDoc_STRVAR(decode_doc,
"decode(ids, positions, labels, bit_start, seq_lens, o0, o1, s0, s1, out_ids, out_positions, out_labels, seq_idx, cu_seq_lens)\n"
"--\n\n"
"Row tokens [o0, o1) and segments [s0, s1) of a batch's flat columns into the out buffers: ids and\n"
"positions widened to int64; labels widened (int32 labels, bit_start -1), or the ids where the\n"
"uint8 bitmap's bit (bit_start + token) is set and -100 elsewhere (format 2), or all -100 (labels\n"
"None: a filler row); each token's segment index (seq_idx) and the cumulative lengths (cu_seq_lens).");

static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 14) {
        PyErr_Format(PyExc_TypeError, "decode: takes 14 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *objs[NBUF] = {args[0], args[1], args[2], args[4], args[9], args[10], args[11], args[12], args[13]};
    /* any integer (numpy's too, through __index__) */
    const Py_ssize_t bit_start = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
    if (bit_start == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t given[4];
    for (int i = 0; i < 4; i++)
        if ((given[i] = PyNumber_AsSsize_t(args[5 + i], PyExc_OverflowError)) == -1 && PyErr_Occurred()) return NULL;
    const Py_ssize_t o0 = given[0], o1 = given[1], s0 = given[2], s1 = given[3];
    if (o0 < 0 || o1 < o0 || s0 < 0 || s1 < s0 || o1 - o0 > INT32_MAX || s1 - s0 > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "decode: need 0 <= o0 <= o1 and 0 <= s0 <= s1, a row of fewer than 2**31 tokens");
        return NULL;
    }
    const int have_labels = objs[LABELS] != Py_None;
    Py_buffer b[NBUF];
    int got = 0;
    PyObject *result = NULL;
    for (; got < NBUF; got++) {
        if (got == LABELS && !have_labels) {
            memset(&b[got], 0, sizeof b[got]);
            continue;
        }
        const int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (got >= OUT_IDS ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[got], &b[got], flags) < 0) goto done;
    }
    if (check(b, have_labels, bit_start, o0, o1, s0, s1) < 0) goto done;
    const Py_ssize_t n = o1 - o0;
    int64_t *ids = b[OUT_IDS].buf, *labels = b[OUT_LABELS].buf;
    widen(&b[IDS], o0, n, ids);
    widen(&b[POS], o0, n, b[OUT_POS].buf);
    if (!have_labels)
        for (Py_ssize_t i = 0; i < n; i++) labels[i] = IGNORE_INDEX;
    else if (bit_start < 0)
        widen(&b[LABELS], o0, n, labels);
    else
        select_bits(b[LABELS].buf, bit_start + o0, n, ids, labels);
    const int32_t *seg = (const int32_t *)b[SEGS].buf + s0;
    int32_t *seq_idx = b[SEQ_IDX].buf, *cu = b[CU].buf;
    int32_t at = 0;  /* the row's tokens fit int32: the loader's cu_seq_lens are int32 */
    cu[0] = 0;
    for (Py_ssize_t s = 0; s < s1 - s0; s++) {
        /* read once and bounded again: a file changed under its memory map may have changed a length
         * since check() summed them (an output overlapping seq_lens is refused there) */
        const int32_t len = seg[s];
        if (len < 0 || len > (int32_t)n - at) {
            PyErr_SetString(PyExc_ValueError, "decode: seq_lens changed while the row was decoded "
                            "(its file changed under it); the outputs are incomplete");
            goto done;
        }
        int32_t *p = seq_idx + at;
        for (int32_t t = 0; t < len; t++) p[t] = (int32_t)s;
        at += len;
        cu[s + 1] = at;
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < got; i++)
        if (b[i].obj != NULL) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowkernel",
                                    "A packed row's tensors from its stored columns in one call (see decode).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rowkernel(void) { return PyModule_Create(&module); }
