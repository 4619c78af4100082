/*
 * packers._native: the two hot loops of packing, in C (optional; packers falls back to its
 * pure-Python versions, which give identical results, when this module is not built).
 *
 *   bfd_assign(sorted_lengths, capacity, rows_out) -> num_rows
 *   ffd_assign(sorted_lengths, capacity, rows_out) -> num_rows
 *   greedy_assign(lengths, capacity, rows_out) -> num_rows
 *   gather_rows(tokens, mask_or_None, doc_src, doc_len, doc_dst, row_start, row_true,
 *               pad_token_id, out_ids, out_mask, row_loss[, threads]) -> None
 *     (out_mask is written only when a source mask is given; without one every token is a
 *      loss token and row_loss is row_true; `threads` > 1 splits the document copies into
 *      that many byte-balanced ranges copied in parallel, outside the GIL; the rows written
 *      do not depend on it)
 *
 * Arguments are buffers (numpy arrays): int64 unless named otherwise; tokens/out_ids int32,
 * mask/out_mask one byte per token. No numpy headers: the buffer protocol only, so building
 * needs a C compiler and Python's headers, nothing else.
 *
 * bfd_assign keeps exactly the data structure of packers/bins.py's Python version: open rows
 * bucketed by remaining room (a LIFO stack per room value), and a two-level bitset over room
 * values to find the smallest room >= length. Same structure, same tie rule, same rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#define HAVE_PTHREAD 1
#endif

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected items of %zd bytes, got %zd", name, itemsize, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---- best-fit decreasing --------------------------------------------------------------- */

static PyObject *bfd_assign(PyObject *self, PyObject *args) {
    PyObject *len_obj, *out_obj;
    long long capacity;
    if (!PyArg_ParseTuple(args, "OLO", &len_obj, &capacity, &out_obj)) return NULL;
    if (capacity < 1) { PyErr_SetString(PyExc_ValueError, "capacity must be >= 1"); return NULL; }
    Py_buffer lv, ov;
    if (get_buffer(len_obj, &lv, 0, 8, "sorted_lengths") < 0) return NULL;
    if (get_buffer(out_obj, &ov, 1, 8, "rows_out") < 0) { PyBuffer_Release(&lv); return NULL; }
    const int64_t *len = (const int64_t *)lv.buf;
    int64_t *out = (int64_t *)ov.buf;
    Py_ssize_t n = lv.len / 8;
    if (ov.len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "rows_out is shorter than sorted_lengths");
        PyBuffer_Release(&lv); PyBuffer_Release(&ov); return NULL;
    }
    int64_t nwords = (capacity >> 6) + 1, ntop = (nwords >> 6) + 1;
    uint64_t *words = calloc((size_t)nwords, 8), *top = calloc((size_t)ntop, 8);
    int64_t *head = malloc((size_t)(capacity + 1) * 8), *next = malloc((size_t)(n > 0 ? n : 1) * 8);
    if (!words || !top || !head || !next) {
        free(words); free(top); free(head); free(next);
        PyBuffer_Release(&lv); PyBuffer_Release(&ov);
        return PyErr_NoMemory();
    }
    for (int64_t r = 0; r <= capacity; r++) head[r] = -1;
    int64_t num_rows = 0, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t L = len[i];
        if (L < 1 || L > capacity) { bad = i; break; }
        int64_t w = L >> 6, room = -1;
        uint64_t m = words[w] >> (L & 63);
        if (m) {
            room = L + __builtin_ctzll(m);
        } else {
            /* next non-empty word after w: first in w's top word, then scan top words */
            int64_t w1 = w + 1, tw = w1 >> 6;
            uint64_t t = (w1 < nwords) ? (top[tw] >> (w1 & 63)) << (w1 & 63) : 0;
            while (!t && ++tw < ntop) t = top[tw];
            if (t) {
                int64_t w2 = (tw << 6) + __builtin_ctzll(t);
                room = (w2 << 6) + __builtin_ctzll(words[w2]);
            }
        }
        int64_t row;
        if (room >= 0) {
            row = head[room];
            head[room] = next[row];
            if (head[room] < 0) {
                int64_t w2 = room >> 6;
                words[w2] &= ~(1ULL << (room & 63));
                if (!words[w2]) top[w2 >> 6] &= ~(1ULL << (w2 & 63));
            }
        } else {
            row = num_rows++;
            room = capacity;
        }
        int64_t left = room - L;
        if (left) {
            if (head[left] < 0) {
                int64_t w2 = left >> 6;
                if (!words[w2]) top[w2 >> 6] |= 1ULL << (w2 & 63);
                words[w2] |= 1ULL << (left & 63);
            }
            next[row] = head[left];
            head[left] = row;
        }
        out[i] = row;
    }
    Py_END_ALLOW_THREADS
    free(words); free(top); free(head); free(next);
    PyBuffer_Release(&lv); PyBuffer_Release(&ov);
    if (bad >= 0) { PyErr_Format(PyExc_ValueError, "sorted_lengths[%lld] is outside [1, capacity]", (long long)bad); return NULL; }
    return PyLong_FromLongLong(num_rows);
}

/* ---- first-fit decreasing: max segment tree over row rooms -------------------------------- */

static PyObject *ffd_assign(PyObject *self, PyObject *args) {
    PyObject *len_obj, *out_obj;
    long long capacity;
    if (!PyArg_ParseTuple(args, "OLO", &len_obj, &capacity, &out_obj)) return NULL;
    Py_buffer lv, ov;
    if (get_buffer(len_obj, &lv, 0, 8, "sorted_lengths") < 0) return NULL;
    if (get_buffer(out_obj, &ov, 1, 8, "rows_out") < 0) { PyBuffer_Release(&lv); return NULL; }
    const int64_t *len = (const int64_t *)lv.buf;
    int64_t *out = (int64_t *)ov.buf;
    Py_ssize_t n = lv.len / 8;
    int64_t size = 1;
    while (size < (n > 0 ? n : 1)) size <<= 1;
    int64_t *tree = malloc((size_t)(2 * size) * 8);
    if (!tree) { PyBuffer_Release(&lv); PyBuffer_Release(&ov); return PyErr_NoMemory(); }
    for (int64_t j = 0; j < 2 * size; j++) tree[j] = capacity;
    int64_t num_rows = 0, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t L = len[i];
        if (L < 1 || L > capacity) { bad = i; break; }
        int64_t node = 1;
        while (node < size) { node <<= 1; if (tree[node] < L) node++; }
        int64_t row = node - size;
        out[i] = row;
        if (row >= num_rows) num_rows = row + 1;
        tree[node] -= L;
        for (node >>= 1; node; node >>= 1) {
            int64_t a = tree[2 * node], b = tree[2 * node + 1];
            tree[node] = a > b ? a : b;
        }
    }
    Py_END_ALLOW_THREADS
    free(tree);
    PyBuffer_Release(&lv); PyBuffer_Release(&ov);
    if (bad >= 0) { PyErr_Format(PyExc_ValueError, "sorted_lengths[%lld] is outside [1, capacity]", (long long)bad); return NULL; }
    return PyLong_FromLongLong(num_rows);
}

/* ---- greedy (next fit, input order) ------------------------------------------------------- */

static PyObject *greedy_assign(PyObject *self, PyObject *args) {
    PyObject *len_obj, *out_obj;
    long long capacity;
    if (!PyArg_ParseTuple(args, "OLO", &len_obj, &capacity, &out_obj)) return NULL;
    Py_buffer lv, ov;
    if (get_buffer(len_obj, &lv, 0, 8, "lengths") < 0) return NULL;
    if (get_buffer(out_obj, &ov, 1, 8, "rows_out") < 0) { PyBuffer_Release(&lv); return NULL; }
    const int64_t *len = (const int64_t *)lv.buf;
    int64_t *out = (int64_t *)ov.buf;
    Py_ssize_t n = lv.len / 8;
    int64_t row = 0, used = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (used + len[i] > capacity) { row++; used = 0; }
        used += len[i];
        out[i] = row;
    }
    PyBuffer_Release(&lv); PyBuffer_Release(&ov);
    return PyLong_FromLongLong(n ? row + 1 : 0);
}

/* ---- materialising rows ----------------------------------------------------------------- */

/* Copy a document into its row. Rows are hundreds of MB written once and not read again here,
 * so large copies use streaming (non-temporal) stores: they skip the read-for-ownership of
 * every destination line that a plain memcpy of a few KB pays (a third of the memory traffic).
 * The caller issues the store fence once, after the last copy. */
static void copy_doc(void *dst, const void *src, size_t n) {
#if defined(__SSE2__)
    if (n >= 2048) {
        char *d = dst;
        const char *s = src;
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        memcpy(d, s, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

static void copy_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* The document copies of one thread: docs [j0, j1). */
typedef struct {
    const int32_t *t;
    const uint8_t *mk;
    const int64_t *s, *dl, *d;
    int32_t *o;
    uint8_t *om;
    Py_ssize_t j0, j1;
} copy_range;

static void *copy_docs(void *arg) {
    const copy_range *c = arg;
    for (Py_ssize_t j = c->j0; j < c->j1; j++) {
        copy_doc(c->o + c->d[j], c->t + c->s[j], (size_t)c->dl[j] * 4);
        if (c->mk) copy_doc(c->om + c->d[j], c->mk + c->s[j], (size_t)c->dl[j]);
    }
    copy_fence();
    return NULL;
}

#define MAX_COPY_THREADS 16

/* Copy every document, split into `threads` ranges of about equal bytes (docs are checked). */
static void copy_all_docs(copy_range base, Py_ssize_t ndocs, int threads) {
    if (threads > MAX_COPY_THREADS) threads = MAX_COPY_THREADS;
    if (threads < 2 || ndocs < 2) {
        base.j0 = 0; base.j1 = ndocs;
        copy_docs(&base);
        return;
    }
    int64_t total = 0;
    for (Py_ssize_t j = 0; j < ndocs; j++) total += base.dl[j];
    copy_range parts[MAX_COPY_THREADS];
    Py_ssize_t j = 0;
    int64_t cum = 0;
    for (int k = 0; k < threads; k++) {
        parts[k] = base;
        parts[k].j0 = j;
        int64_t goal = total * (k + 1) / threads; /* the last range's goal is the total */
        while (j < ndocs && cum < goal) cum += base.dl[j++];
        parts[k].j1 = k == threads - 1 ? ndocs : j;
    }
#ifdef HAVE_PTHREAD
    pthread_t tid[MAX_COPY_THREADS];
    int started[MAX_COPY_THREADS] = {0};
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&tid[k], NULL, copy_docs, &parts[k]) == 0;
    copy_docs(&parts[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k]) pthread_join(tid[k], NULL);
        else copy_docs(&parts[k]); /* could not start a thread: copy here */
    }
#else
    for (int k = 0; k < threads; k++) copy_docs(&parts[k]);
#endif
}

static PyObject *gather_rows(PyObject *self, PyObject *args) {
    PyObject *tok_o, *mask_o, *src_o, *dlen_o, *dst_o, *rstart_o, *rtrue_o, *oid_o, *omask_o, *rloss_o;
    long long pad_id;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOOLOOO|i", &tok_o, &mask_o, &src_o, &dlen_o, &dst_o, &rstart_o, &rtrue_o, &pad_id,
                          &oid_o, &omask_o, &rloss_o, &threads))
        return NULL;
    Py_buffer tok, mask = {0}, src, dlen, dst, rstart, rtrue, oid, omask, rloss;
    int have_mask = mask_o != Py_None;
    if (get_buffer(tok_o, &tok, 0, 4, "tokens") < 0) return NULL;
    if (have_mask && get_buffer(mask_o, &mask, 0, 1, "mask") < 0) goto e0;
    if (get_buffer(src_o, &src, 0, 8, "doc_src") < 0) goto e1;
    if (get_buffer(dlen_o, &dlen, 0, 8, "doc_len") < 0) goto e2;
    if (get_buffer(dst_o, &dst, 0, 8, "doc_dst") < 0) goto e3;
    if (get_buffer(rstart_o, &rstart, 0, 8, "row_start") < 0) goto e4;
    if (get_buffer(rtrue_o, &rtrue, 0, 8, "row_true") < 0) goto e5;
    if (get_buffer(oid_o, &oid, 1, 4, "out_ids") < 0) goto e6;
    if (get_buffer(omask_o, &omask, 1, 1, "out_mask") < 0) goto e7;
    if (get_buffer(rloss_o, &rloss, 1, 8, "row_loss") < 0) goto e8;
    {
        const int32_t *t = tok.buf;
        const uint8_t *mk = have_mask ? mask.buf : NULL;
        const int64_t *s = src.buf, *dl = dlen.buf, *d = dst.buf, *rs = rstart.buf, *rt = rtrue.buf;
        int32_t *o = oid.buf;
        uint8_t *om = omask.buf;
        int64_t *rl = rloss.buf;
        Py_ssize_t ndocs = dlen.len / 8, nrows = rtrue.len / 8, ntok = tok.len / 4, nout = oid.len / 4;
        int ok = 1;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < ndocs && ok; j++) {
            if (s[j] < 0 || dl[j] < 0 || s[j] + dl[j] > ntok || d[j] < 0 || d[j] + dl[j] > nout || (mk && d[j] + dl[j] > omask.len)) { ok = 0; break; }
        }
        if (ok) {
            copy_range base = {t, mk, s, dl, d, o, om, 0, ndocs};
            copy_all_docs(base, ndocs, threads);
        }
        /* without a source mask out_mask is not written (the caller builds the bitmap) */
        for (Py_ssize_t r = 0; r < nrows && ok; r++) {
            int64_t a = rs[r] + rt[r], b = rs[r + 1];
            if (b > nout || (mk && b > omask.len)) { ok = 0; break; }
            for (int64_t p = a; p < b; p++) { o[p] = (int32_t)pad_id; if (mk) om[p] = 0; }
            int64_t c = 0;
            if (mk) { for (int64_t p = rs[r]; p < a; p++) c += om[p] != 0; }
            else c = rt[r];
            rl[r] = c;
        }
        Py_END_ALLOW_THREADS
        if (!ok) PyErr_SetString(PyExc_ValueError, "gather_rows: a document reaches outside its buffers");
    }
    PyBuffer_Release(&rloss);
e8: PyBuffer_Release(&omask);
e7: PyBuffer_Release(&oid);
e6: PyBuffer_Release(&rtrue);
e5: PyBuffer_Release(&rstart);
e4: PyBuffer_Release(&dst);
e3: PyBuffer_Release(&dlen);
e2: PyBuffer_Release(&src);
e1: if (have_mask) PyBuffer_Release(&mask);
e0: PyBuffer_Release(&tok);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bfd_assign", bfd_assign, METH_VARARGS, "best-fit decreasing rows for lengths sorted decreasingly"},
    {"ffd_assign", ffd_assign, METH_VARARGS, "first-fit decreasing rows for lengths sorted decreasingly"},
    {"greedy_assign", greedy_assign, METH_VARARGS, "next-fit rows in input order"},
    {"gather_rows", gather_rows, METH_VARARGS, "copy documents into padded rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "packshard.packers._native", "C hot loops of packers (optional)", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
