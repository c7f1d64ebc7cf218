/* The suffix drafter's inner loops in native code: the token index (token_index.py says
 * what it indexes and why; this file is how it is stored), the output cache's probe of every
 * cached output (holding), the walk of a match's occurrences (follow: SuffixProposer._walk
 * says why each of its rules is there) and the calibration its confidences come from
 * (Calibration: confidence.py's AcceptanceStats, whose docstring states the arithmetic).
 *
 * The drafter looks its history's tail up in the request's own index and in every cached
 * output's at every draft step, and walks what it found token by token; in Python that was
 * 43-50 % of the default method's host time per committed token on a 2-core CPU
 * (bench/drafter_host.py). Here a sequence is flat arrays (tokens, prefix hashes, and per
 * order a chain of previous occurrences) and per order an open-addressing table from a
 * context's hash to its most recent end, so a lookup touches a few cache lines instead of a
 * few dozen Python objects.
 *
 * The hashes are token_index.tail_keys's (keys computed in Python look up here); the walk's
 * and the calibration's results are the Python code's it replaced, bit for bit
 * (tests/engine/test_token_index.py states both in plain Python; bench/drafter_host.py stops
 * on any draft that differs from a recorded round's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define N_ORDERS 7
static const Py_ssize_t ORDERS[N_ORDERS] = {64, 32, 16, 8, 4, 2, 1};
#define MAX_OCCURRENCES 16
#define BASE 0x9E3779B97F4A7C15ULL
/* Fibonacci hashing: a polynomial hash's low bits depend only on the tokens' low bits, so
 * a table slot takes the high bits of the key times an odd constant. */
#define MIX 0xD6E8FEB86659FD93ULL
#define EMPTY (-1)
/* Tokens the arrays first hold, and log2 of a table's first slots. */
#define INITIAL_TOKENS 16
#define INITIAL_LOG2_SLOTS 4
/* Bytes an index allocates per token at most: its arrays (token, prefix hash, a chain slot
 * per order) at twice the length (they double), and per order a table slot at four times
 * the contexts (tables double past half full). */
#define BYTES_PER_TOKEN (2 * (2 + N_ORDERS) * 8 + N_ORDERS * 4 * 16)
/* Bytes an empty index allocates. */
#define BYTES_EMPTY ((INITIAL_TOKENS * (2 + N_ORDERS) + 1) * 8 + \
                     N_ORDERS * (16 << INITIAL_LOG2_SLOTS))

static uint64_t POWERS[N_ORDERS]; /* BASE^n mod 2^64 per order */

typedef struct {
    uint64_t key;
    int64_t end; /* EMPTY: a free slot */
} Slot;

typedef struct {
    Slot *slots;
    Py_ssize_t used;
    int shift; /* 64 - log2(capacity) */
} Table;

typedef struct {
    PyObject_HEAD
    int64_t *tokens;
    Py_ssize_t len, cap;
    /* prefix[i]: the hash of tokens[:i], for i <= indexed. */
    uint64_t *prefix;
    /* Tokens indexed so far: ends below indexed - 1 have a follower and are in the tables. */
    Py_ssize_t indexed;
    /* chains[k][e]: the previous end of the context of order k ending at e (-1: none),
     * for e < indexed - 1; the arrays share the tokens' capacity. */
    int64_t *chains[N_ORDERS];
    Table tables[N_ORDERS];
} TokenIndex;

static PyTypeObject TokenIndexType;

/* ---- the tables --------------------------------------------------------------------- */

static int table_init(Table *t, int log2cap) {
    Py_ssize_t cap = (Py_ssize_t)1 << log2cap;
    t->slots = PyMem_Malloc(cap * sizeof(Slot));
    if (t->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < cap; i++) t->slots[i].end = EMPTY;
    t->used = 0;
    t->shift = 64 - log2cap;
    return 0;
}

static inline Py_ssize_t table_cap(const Table *t) { return (Py_ssize_t)1 << (64 - t->shift); }

static inline Slot *table_find(const Table *t, uint64_t key) {
    Py_ssize_t mask = table_cap(t) - 1;
    Py_ssize_t i = (Py_ssize_t)((key * MIX) >> t->shift);
    while (t->slots[i].end != EMPTY && t->slots[i].key != key) i = (i + 1) & mask;
    return &t->slots[i];
}

static int table_grow(Table *t) {
    Table bigger;
    if (table_init(&bigger, 64 - t->shift + 1) < 0) return -1;
    Py_ssize_t cap = table_cap(t);
    for (Py_ssize_t i = 0; i < cap; i++) {
        if (t->slots[i].end != EMPTY) *table_find(&bigger, t->slots[i].key) = t->slots[i];
    }
    bigger.used = t->used;
    PyMem_Free(t->slots);
    *t = bigger;
    return 0;
}

/* Sets key's most recent end to ``end``; returns the end it had (-1: none), -2 on error. */
static int64_t table_put(Table *t, uint64_t key, int64_t end) {
    if (2 * (t->used + 1) > table_cap(t) && table_grow(t) < 0) return -2;
    Slot *s = table_find(t, key);
    int64_t previous = s->end;
    if (previous == EMPTY) t->used++;
    s->key = key;
    s->end = end;
    return previous;
}

static inline int64_t table_get(const Table *t, uint64_t key) { return table_find(t, key)->end; }

/* ---- the sequence ------------------------------------------------------------------- */

static int reserve(TokenIndex *self, Py_ssize_t need) {
    if (need <= self->cap) return 0;
    Py_ssize_t cap = self->cap ? self->cap : INITIAL_TOKENS;
    while (cap < need) cap *= 2;
    int64_t *tokens = PyMem_Realloc(self->tokens, cap * sizeof(int64_t));
    if (tokens == NULL) goto fail;
    self->tokens = tokens;
    uint64_t *prefix = PyMem_Realloc(self->prefix, (cap + 1) * sizeof(uint64_t));
    if (prefix == NULL) goto fail;
    self->prefix = prefix;
    for (int k = 0; k < N_ORDERS; k++) {
        int64_t *chain = PyMem_Realloc(self->chains[k], cap * sizeof(int64_t));
        if (chain == NULL) goto fail;
        self->chains[k] = chain;
    }
    self->cap = cap;
    return 0;
fail:
    PyErr_NoMemory();
    return -1;
}

/* Indexes what append left unindexed: each context that now has a follower. */
static int catch_up(TokenIndex *self) {
    for (Py_ssize_t p = self->indexed; p < self->len; p++) {
        Py_ssize_t end = p - 1; /* the context ending here gets tokens[p] as its follower */
        const uint64_t *prefix = self->prefix;
        uint64_t h = prefix[p];
        for (int k = 0; k < N_ORDERS; k++) {
            Py_ssize_t n = ORDERS[k];
            if (end < 0) continue;
            if (end + 1 < n) {
                self->chains[k][end] = -1;
                continue;
            }
            uint64_t key = h - prefix[end + 1 - n] * POWERS[k];
            int64_t previous = table_put(&self->tables[k], key, end);
            if (previous == -2) return -1;
            self->chains[k][end] = previous;
        }
        self->prefix[p + 1] = h * BASE + (uint64_t)self->tokens[p] + 1;
        self->indexed = p + 1;
    }
    return 0;
}

static int append_tokens(TokenIndex *self, PyObject *iterable) {
    PyObject *seq = PySequence_Fast(iterable, "tokens must be a sequence of ints");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (reserve(self, self->len + n) < 0) {
        Py_DECREF(seq);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long t = PyLong_AsLongLong(items[i]);
        if (t == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (t < 0) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "a token id is never negative, got %lld", t);
            return -1;
        }
        self->tokens[self->len + i] = t;
    }
    self->len += n;
    Py_DECREF(seq);
    return 0;
}

/* ---- the type ----------------------------------------------------------------------- */

/* Allocated ready to use: every method may run on an index made by ``__new__`` alone. */
static PyObject *TokenIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    TokenIndex *self = (TokenIndex *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    if (reserve(self, 1) < 0) goto fail;
    self->prefix[0] = 0;
    for (int k = 0; k < N_ORDERS; k++) {
        if (table_init(&self->tables[k], INITIAL_LOG2_SLOTS) < 0) goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static int TokenIndex_init(TokenIndex *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tokens", NULL};
    PyObject *tokens = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &tokens)) return -1;
    if (self->len > 0) {
        PyErr_SetString(PyExc_TypeError, "a TokenIndex is initialised once");
        return -1;
    }
    if (tokens != NULL && (append_tokens(self, tokens) < 0 || catch_up(self) < 0)) return -1;
    return 0;
}

static void TokenIndex_dealloc(TokenIndex *self) {
    PyMem_Free(self->tokens);
    PyMem_Free(self->prefix);
    for (int k = 0; k < N_ORDERS; k++) {
        PyMem_Free(self->chains[k]);
        PyMem_Free(self->tables[k].slots);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_order(Py_ssize_t order) {
    if (order < 0 || order >= N_ORDERS) {
        PyErr_Format(PyExc_IndexError, "order %zd is not one of the %d indexed", order,
                     N_ORDERS);
        return -1;
    }
    return 0;
}

static PyObject *TokenIndex_append(TokenIndex *self, PyObject *tokens) {
    if (append_tokens(self, tokens) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *TokenIndex_extend(TokenIndex *self, PyObject *tokens) {
    if (append_tokens(self, tokens) < 0 || catch_up(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *TokenIndex_catch_up(TokenIndex *self, PyObject *unused) {
    if (catch_up(self) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Follower positions of the most recent occurrences of a context, newest first. */
static PyObject *occurrences(TokenIndex *self, Py_ssize_t order, uint64_t key) {
    PyObject *found = PyList_New(0);
    if (found == NULL) return NULL;
    int64_t end = table_get(&self->tables[order], key);
    const int64_t *chain = self->chains[order];
    while (end >= 0 && PyList_GET_SIZE(found) < MAX_OCCURRENCES) {
        PyObject *start = PyLong_FromLongLong(end + 1);
        if (start == NULL || PyList_Append(found, start) < 0) {
            Py_XDECREF(start);
            Py_DECREF(found);
            return NULL;
        }
        Py_DECREF(start);
        if (chain[end] >= end) break; /* chains only go back (a guard, never taken) */
        end = chain[end];
    }
    return found;
}

static int parse_key(PyObject *args, Py_ssize_t *order, uint64_t *key) {
    PyObject *key_obj;
    if (!PyArg_ParseTuple(args, "nO", order, &key_obj) || check_order(*order) < 0) return -1;
    *key = PyLong_AsUnsignedLongLongMask(key_obj);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *TokenIndex_occurrences(TokenIndex *self, PyObject *args) {
    Py_ssize_t order;
    uint64_t key;
    if (parse_key(args, &order, &key) < 0 || catch_up(self) < 0) return NULL;
    return occurrences(self, order, key);
}

static PyObject *TokenIndex_tail_keys(TokenIndex *self, PyObject *unused) {
    if (catch_up(self) < 0) return NULL;
    PyObject *keys = PyList_New(N_ORDERS);
    if (keys == NULL) return NULL;
    Py_ssize_t size = self->len;
    for (int k = 0; k < N_ORDERS; k++) {
        PyObject *key;
        if (ORDERS[k] <= size) {
            key = PyLong_FromUnsignedLongLong(self->prefix[size] -
                                              self->prefix[size - ORDERS[k]] * POWERS[k]);
            if (key == NULL) {
                Py_DECREF(keys);
                return NULL;
            }
        } else {
            key = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(keys, k, key);
    }
    return keys;
}

/* What the index allocates now, with its unindexed tokens' share as it will once they are. */
static PyObject *TokenIndex_allocated(TokenIndex *self, PyObject *unused) {
    size_t bytes = (size_t)self->cap * (sizeof(int64_t) * (1 + N_ORDERS)) +
                   (size_t)(self->cap + 1) * sizeof(uint64_t);
    for (int k = 0; k < N_ORDERS; k++) bytes += (size_t)table_cap(&self->tables[k]) * sizeof(Slot);
    return PyLong_FromSize_t(bytes);
}

/* Accounted size, what the output cache bounds: at least what the index allocates now or
 * once its unindexed tokens are indexed, whatever the tokens. */
static PyObject *TokenIndex_nbytes(TokenIndex *self, PyObject *unused) {
    return PyLong_FromSsize_t(BYTES_EMPTY + self->len * BYTES_PER_TOKEN);
}

static PyObject *TokenIndex_reduce(TokenIndex *self, PyObject *unused);

static Py_ssize_t TokenIndex_len(TokenIndex *self) { return self->len; }

static PyObject *token_slice(TokenIndex *self, Py_ssize_t start, Py_ssize_t stop) {
    if (start < 0) start = 0;
    if (stop > self->len) stop = self->len;
    Py_ssize_t n = stop > start ? stop - start : 0;
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyLong_FromLongLong(self->tokens[start + i]);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *TokenIndex_subscript(TokenIndex *self, PyObject *item) {
    if (PyIndex_Check(item)) {
        Py_ssize_t i = PyNumber_AsSsize_t(item, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0) i += self->len;
        if (i < 0 || i >= self->len) {
            PyErr_SetString(PyExc_IndexError, "token index out of range");
            return NULL;
        }
        return PyLong_FromLongLong(self->tokens[i]);
    }
    if (PySlice_Check(item)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(item, &start, &stop, &step) < 0) return NULL;
        if (step != 1) {
            PyErr_SetString(PyExc_ValueError, "a TokenIndex slices with step 1 only");
            return NULL;
        }
        PySlice_AdjustIndices(self->len, &start, &stop, step);
        return token_slice(self, start, stop);
    }
    PyErr_Format(PyExc_TypeError, "a TokenIndex is indexed by int or slice, not %.100s",
                 Py_TYPE(item)->tp_name);
    return NULL;
}

static PyObject *TokenIndex_get_tokens(TokenIndex *self, void *closure) {
    return token_slice(self, 0, self->len);
}

static PyObject *TokenIndex_reduce(TokenIndex *self, PyObject *unused) {
    PyObject *tokens = token_slice(self, 0, self->len);
    if (tokens == NULL) return NULL;
    return Py_BuildValue("O(N)", Py_TYPE(self), tokens);
}

static PyMethodDef TokenIndex_methods[] = {
    {"append", (PyCFunction)TokenIndex_append, METH_O,
     "Append tokens now; they are indexed when the index is next read."},
    {"extend", (PyCFunction)TokenIndex_extend, METH_O, "Append tokens and index them."},
    {"catch_up", (PyCFunction)TokenIndex_catch_up, METH_NOARGS,
     "Index what append left unindexed."},
    {"occurrences", (PyCFunction)TokenIndex_occurrences, METH_VARARGS,
     "occurrences(order, key): follower positions of the context's most recent occurrences, "
     "newest first."},
    {"tail_keys", (PyCFunction)TokenIndex_tail_keys, METH_NOARGS,
     "The hash of the sequence's last n tokens per order (None where it is shorter)."},
    {"nbytes", (PyCFunction)TokenIndex_nbytes, METH_NOARGS,
     "Accounted size: at least what the index allocates, once indexed."},
    {"allocated", (PyCFunction)TokenIndex_allocated, METH_NOARGS,
     "Bytes the index's arrays and tables hold now."},
    {"__reduce__", (PyCFunction)TokenIndex_reduce, METH_NOARGS, "Rebuilt from its tokens."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef TokenIndex_getset[] = {
    {"tokens", (getter)TokenIndex_get_tokens, NULL, "The sequence, as a new list.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods TokenIndex_as_mapping = {
    .mp_length = (lenfunc)TokenIndex_len,
    .mp_subscript = (binaryfunc)TokenIndex_subscript,
};

static PySequenceMethods TokenIndex_as_sequence = {
    .sq_length = (lenfunc)TokenIndex_len,
};

static PyTypeObject TokenIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "worker.engine.proposers._lookup.TokenIndex",
    .tp_doc = "An append-only token sequence with its context index (token_index.py).",
    .tp_basicsize = sizeof(TokenIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = TokenIndex_new,
    .tp_init = (initproc)TokenIndex_init,
    .tp_dealloc = (destructor)TokenIndex_dealloc,
    .tp_methods = TokenIndex_methods,
    .tp_getset = TokenIndex_getset,
    .tp_as_mapping = &TokenIndex_as_mapping,
    .tp_as_sequence = &TokenIndex_as_sequence,
};

/* ---- the output cache's probe ------------------------------------------------------- */

/* holding(items, order, key, entry): of the (id, TokenIndex) pairs of ``items``, in order,
 * those but ``entry`` whose index holds the context (OutputCache.holding). */
static PyObject *holding(PyObject *module, PyObject *args) {
    PyObject *items, *key_obj, *entry;
    Py_ssize_t order;
    if (!PyArg_ParseTuple(args, "OnOO", &items, &order, &key_obj, &entry) ||
        check_order(order) < 0)
        return NULL;
    uint64_t key = PyLong_AsUnsignedLongLongMask(key_obj);
    if (PyErr_Occurred()) return NULL;
    PyObject *it = PyObject_GetIter(items);
    if (it == NULL) return NULL;
    PyObject *found = PyList_New(0);
    PyObject *pair;
    while (found != NULL && (pair = PyIter_Next(it)) != NULL) {
        int keep = 0;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyObject_TypeCheck(PyTuple_GET_ITEM(pair, 1), &TokenIndexType)) {
            PyErr_SetString(PyExc_TypeError, "holding takes (id, TokenIndex) pairs");
            keep = -1;
        } else {
            TokenIndex *index = (TokenIndex *)PyTuple_GET_ITEM(pair, 1);
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(pair, 0), entry, Py_EQ);
            if (same < 0 || (!same && catch_up(index) < 0)) keep = -1;
            else keep = !same && table_get(&index->tables[order], key) >= 0;
        }
        if (keep < 0 || (keep && PyList_Append(found, pair) < 0)) Py_CLEAR(found);
        Py_DECREF(pair);
    }
    Py_DECREF(it);
    if (found != NULL && PyErr_Occurred()) Py_CLEAR(found);
    return found;
}



/* ---- the acceptance calibration (confidence.py) ------------------------------------- */

/* The evidence cells: (source, depth bucket, support bucket, agreement, fragility). */
#define DEPTH_BUCKETS 7
#define SUPPORT_BUCKETS 5
#define AGREEMENTS 4
#define FRAGILITIES 3
#define N_CELLS (2 * DEPTH_BUCKETS * SUPPORT_BUCKETS * AGREEMENTS * FRAGILITIES)

typedef struct {
    PyObject_HEAD
    double depth_prior[DEPTH_BUCKETS];
    double fragile_prior[FRAGILITIES];
    double prior_occurrences, prior_trials, max_trials;
    double hits[N_CELLS], trials[N_CELLS];
} Calibration;

static PyTypeObject CalibrationType;

static int bit_length(Py_ssize_t x) {
    int n = 0;
    while (x > 0) {
        n++;
        x >>= 1;
    }
    return n;
}

/* A bucket as Python's ``TABLE[min(x.bit_length(), len(TABLE)) - 1]`` indexes (-1: the last). */
static int bucket_of(Py_ssize_t x, int buckets) {
    int b = bit_length(x);
    b = (b < buckets ? b : buckets) - 1;
    return b < 0 ? buckets - 1 : b;
}

/* The calibrated acceptance probability of a candidate, and its cell (confidence.py). */
static double confidence(const Calibration *c, Py_ssize_t depth, Py_ssize_t support,
                         Py_ssize_t agree, int shared, long fragile, int *cell) {
    double share = (double)agree / (double)support;
    int agreement = share >= 1.0 ? 0 : share >= 0.75 ? 1 : share >= 0.5 ? 2 : 3;
    int depth_bucket = bucket_of(depth, DEPTH_BUCKETS);
    int support_bucket = bit_length(support) < 4 ? bit_length(support) : 4;
    *cell = (((shared * DEPTH_BUCKETS + depth_bucket) * SUPPORT_BUCKETS + support_bucket) *
                 AGREEMENTS + agreement) * FRAGILITIES + (int)fragile;
    double prior = c->depth_prior[depth_bucket];
    double guess = ((double)agree + c->prior_occurrences * prior) /
                   ((double)support + c->prior_occurrences);
    guess = guess * c->fragile_prior[fragile];
    return (c->hits[*cell] + c->prior_trials * guess) / (c->trials[*cell] + c->prior_trials);
}

static int read_doubles(PyObject *values, double *out, Py_ssize_t n, const char *what) {
    PyObject *seq = PySequence_Fast(values, what);
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values, not %zd", what,
                     PySequence_Fast_GET_SIZE(seq), n);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static int Calibration_init(Calibration *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"depth_prior", "prior_occurrences", "prior_trials", "max_trials",
                             "fragile_prior", NULL};
    PyObject *depth_prior, *fragile_prior;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OdddO", kwlist, &depth_prior,
                                     &self->prior_occurrences, &self->prior_trials,
                                     &self->max_trials, &fragile_prior) ||
        read_doubles(depth_prior, self->depth_prior, DEPTH_BUCKETS, "depth_prior") < 0 ||
        read_doubles(fragile_prior, self->fragile_prior, FRAGILITIES, "fragile_prior") < 0)
        return -1;
    memset(self->hits, 0, sizeof self->hits);
    memset(self->trials, 0, sizeof self->trials);
    return 0;
}

static int check_evidence(Py_ssize_t depth, Py_ssize_t support, Py_ssize_t agree,
                          long fragile) {
    if (depth < 1 || support < 1 || agree < 1 || agree > support || fragile < 0 ||
        fragile >= FRAGILITIES) {
        PyErr_Format(PyExc_ValueError,
                     "evidence must have depth >= 1, 1 <= agree <= support and fragility "
                     "0..%d, got depth %zd, support %zd, agree %zd, fragility %ld",
                     FRAGILITIES - 1, depth, support, agree, fragile);
        return -1;
    }
    return 0;
}

static PyObject *Calibration_confidence(Calibration *self, PyObject *args) {
    Py_ssize_t depth, support, agree;
    int shared;
    long fragile;
    if (!PyArg_ParseTuple(args, "nnnpl", &depth, &support, &agree, &shared, &fragile) ||
        check_evidence(depth, support, agree, fragile) < 0)
        return NULL;
    int cell;
    double p = confidence(self, depth, support, agree, shared, fragile, &cell);
    return Py_BuildValue("(di)", p, cell);
}

static PyObject *Calibration_record(Calibration *self, PyObject *args) {
    int cell, accepted;
    if (!PyArg_ParseTuple(args, "ip", &cell, &accepted)) return NULL;
    if (cell < 0 || cell >= N_CELLS) {
        PyErr_Format(PyExc_ValueError, "no evidence cell %d", cell);
        return NULL;
    }
    self->hits[cell] += accepted;
    self->trials[cell] += 1.0;
    if (self->trials[cell] > self->max_trials) {
        self->hits[cell] /= 2.0;
        self->trials[cell] /= 2.0;
    }
    Py_RETURN_NONE;
}

static PyObject *doubles(const double *values, Py_ssize_t n) {
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyFloat_FromDouble(values[i]);
        if (v == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *Calibration_getstate(Calibration *self, PyObject *unused) {
    return Py_BuildValue("(NdddNNN)", doubles(self->depth_prior, DEPTH_BUCKETS),
                         self->prior_occurrences, self->prior_trials, self->max_trials,
                         doubles(self->fragile_prior, FRAGILITIES),
                         doubles(self->hits, N_CELLS), doubles(self->trials, N_CELLS));
}

static PyObject *Calibration_setstate(Calibration *self, PyObject *state) {
    PyObject *depth_prior, *fragile_prior, *hits, *trials;
    if (!PyArg_ParseTuple(state, "OdddOOO", &depth_prior, &self->prior_occurrences,
                          &self->prior_trials, &self->max_trials, &fragile_prior, &hits,
                          &trials) ||
        read_doubles(depth_prior, self->depth_prior, DEPTH_BUCKETS, "depth_prior") < 0 ||
        read_doubles(fragile_prior, self->fragile_prior, FRAGILITIES, "fragile_prior") < 0 ||
        read_doubles(hits, self->hits, N_CELLS, "hits") < 0 ||
        read_doubles(trials, self->trials, N_CELLS, "trials") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Calibration_methods[] = {
    {"confidence", (PyCFunction)Calibration_confidence, METH_VARARGS,
     "confidence(depth, support, agree, shared, fragile) -> (probability, cell)"},
    {"record", (PyCFunction)Calibration_record, METH_VARARGS,
     "record(cell, accepted): one verified draft token of the cell."},
    {"__getstate__", (PyCFunction)Calibration_getstate, METH_NOARGS, "Priors and counts."},
    {"__setstate__", (PyCFunction)Calibration_setstate, METH_O, "Priors and counts."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CalibrationType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "worker.engine.proposers._lookup.Calibration",
    .tp_doc = "Measured acceptance per evidence cell (confidence.py's AcceptanceStats).",
    .tp_basicsize = sizeof(Calibration),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Calibration_init,
    .tp_methods = Calibration_methods,
};

/* ---- the suffix drafter's walk ------------------------------------------------------ */

typedef struct {
    TokenIndex *index;
    Py_ssize_t start;
    PyObject *fragile; /* a dict: position -> fragility; NULL when empty */
    int64_t token;     /* what it goes on with at this step */
} Walker;

/* The fragility a walker holds its continuation at, position ``at`` (0 when firm). */
static int fragility_at(const Walker *w, Py_ssize_t at, long *out) {
    *out = 0;
    if (w->fragile == NULL) return 0;
    PyObject *key = PyLong_FromSsize_t(at);
    if (key == NULL) return -1;
    PyObject *level = PyDict_GetItemWithError(w->fragile, key);
    Py_DECREF(key);
    if (level == NULL) return PyErr_Occurred() ? -1 : 0;
    *out = PyLong_AsLong(level);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* follow(occurrences, width, wraps, ends, stats, depth, shared, scale, p_min, min_reach,
 *        length) -> (tokens, confidences, cells): SuffixProposer._walk's token-by-token walk
 * of the occurrences' continuations (its docstring says why each rule is there).
 *
 * Each step takes the token most of the live occurrences go on with (ties: the earliest in
 * ``occurrences``, the most recent) and keeps only the occurrences that agree; an occurrence
 * that runs past its sequence's end goes on with the walk's own tokens when ``wraps``, else
 * it ends. The token is drafted at its calibrated confidence (``stats``, with the evidence:
 * the match's depth so far, the live occurrences, how many agree, the highest fragility an
 * agreeing one holds it at) times ``scale``. The walk stops before a token ``ends`` says
 * ends a generation (None: none does), a token below ``p_min``, a draft whose chance of
 * being accepted whole falls below ``min_reach``, and after the token where
 * ``length.add(p, tokens left)`` says no longer draft could be kept. */
/* The name of the draft-length chooser's method, interned once at import. */
static PyObject *ADD_NAME;

static PyObject *follow(PyObject *module, PyObject *args) {
    PyObject *occurrences, *ends, *stats_obj, *length;
    Py_ssize_t width, depth;
    int wraps, shared;
    double scale, p_min, min_reach;
    if (!PyArg_ParseTuple(args, "O!npOO!npdddO", &PyList_Type, &occurrences, &width, &wraps,
                          &ends, &CalibrationType, &stats_obj, &depth, &shared, &scale,
                          &p_min, &min_reach, &length))
        return NULL;
    const Calibration *stats = (const Calibration *)stats_obj;
    Py_ssize_t n = PyList_GET_SIZE(occurrences);
    PyObject *tokens = PyList_New(0), *confidences = PyList_New(0), *cells = PyList_New(0);
    Walker *live = PyMem_Malloc((n ? n : 1) * sizeof(Walker));
    int64_t *walked = PyMem_Malloc((width > 0 ? width : 1) * sizeof(int64_t));
    int64_t *distinct = PyMem_Malloc((n ? n : 1) * sizeof(int64_t));
    Py_ssize_t *counts = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    PyObject *result = NULL;
    if (tokens == NULL || confidences == NULL || cells == NULL) goto done;
    if (live == NULL || walked == NULL || distinct == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t o = 0; o < n; o++) {
        PyObject *occ = PyList_GET_ITEM(occurrences, o);
        if (!PyTuple_Check(occ) || PyTuple_GET_SIZE(occ) != 3 ||
            !PyObject_TypeCheck(PyTuple_GET_ITEM(occ, 0), &TokenIndexType) ||
            !PyDict_Check(PyTuple_GET_ITEM(occ, 2))) {
            PyErr_SetString(PyExc_TypeError, "follow takes (TokenIndex, start, dict) triples");
            goto done;
        }
        live[o].index = (TokenIndex *)PyTuple_GET_ITEM(occ, 0);
        live[o].start = PyLong_AsSsize_t(PyTuple_GET_ITEM(occ, 1));
        if (live[o].start == -1 && PyErr_Occurred()) goto done;
        PyObject *fragile = PyTuple_GET_ITEM(occ, 2);
        live[o].fragile = PyDict_GET_SIZE(fragile) ? fragile : NULL;
    }
    double reach = 1.0;
    for (Py_ssize_t i = 0; i < width; i++) {
        /* What each live occurrence goes on with; the distinct tokens in first-seen order. */
        Py_ssize_t going = 0, kinds = 0;
        for (Py_ssize_t o = 0; o < n; o++) {
            Walker *w = &live[o];
            Py_ssize_t j = w->start + i;
            if (j < w->index->len) {
                w->token = w->index->tokens[j];
            } else if (wraps && j - w->index->len < i) {
                w->token = walked[j - w->index->len];
            } else {
                continue; /* it ends here */
            }
            live[going++] = *w;
            Py_ssize_t d = 0;
            while (d < kinds && distinct[d] != w->token) d++;
            if (d == kinds) {
                distinct[kinds++] = w->token;
                counts[d] = 0;
            }
            counts[d]++;
        }
        n = going;
        if (n == 0) break;
        Py_ssize_t best = 0;
        for (Py_ssize_t d = 1; d < kinds; d++) {
            if (counts[d] > counts[best]) best = d;
        }
        int64_t token = distinct[best];
        PyObject *token_obj = PyLong_FromLongLong(token);
        if (token_obj == NULL) goto done;
        if (ends != Py_None) {
            PyObject *verdict = PyObject_CallOneArg(ends, token_obj);
            int stop = verdict == NULL ? -1 : PyObject_IsTrue(verdict);
            Py_XDECREF(verdict);
            if (stop) {
                Py_DECREF(token_obj);
                if (stop < 0) goto done;
                break;
            }
        }
        long fragile = 0;
        Py_ssize_t agree = 0;
        for (Py_ssize_t o = 0; o < n; o++) {
            if (live[o].token != token) continue;
            long level;
            if (fragility_at(&live[o], live[o].start + i, &level) < 0) {
                Py_DECREF(token_obj);
                goto done;
            }
            if (level > fragile) fragile = level;
            live[agree++] = live[o];
        }
        if (fragile < 0 || fragile >= FRAGILITIES) {
            Py_DECREF(token_obj);
            PyErr_Format(PyExc_ValueError, "no fragility %ld", fragile);
            goto done;
        }
        int cell;
        double p = confidence(stats, depth + i, n, agree, shared, fragile, &cell) * scale;
        reach *= p;
        if (p < p_min || reach < min_reach) {
            Py_DECREF(token_obj);
            break;
        }
        PyObject *p_obj = PyFloat_FromDouble(p), *cell_obj = PyLong_FromLong(cell);
        int failed = p_obj == NULL || cell_obj == NULL || PyList_Append(tokens, token_obj) < 0 ||
                     PyList_Append(confidences, p_obj) < 0 || PyList_Append(cells, cell_obj) < 0;
        Py_DECREF(token_obj);
        if (failed) {
            Py_XDECREF(p_obj);
            Py_XDECREF(cell_obj);
            goto done;
        }
        Py_DECREF(cell_obj);
        PyObject *left = PyLong_FromSsize_t(width - i - 1);
        PyObject *verdict = left == NULL ? NULL
                                         : PyObject_CallMethodObjArgs(length, ADD_NAME, p_obj,
                                                                      left, NULL);
        Py_DECREF(p_obj);
        Py_XDECREF(left);
        int more = verdict == NULL ? -1 : PyObject_IsTrue(verdict);
        Py_XDECREF(verdict);
        if (more < 0) goto done;
        if (!more) break;
        walked[i] = token;
        n = agree;
    }
    result = PyTuple_Pack(3, tokens, confidences, cells);
done:
    Py_XDECREF(tokens);
    Py_XDECREF(confidences);
    Py_XDECREF(cells);
    PyMem_Free(live);
    PyMem_Free(walked);
    PyMem_Free(distinct);
    PyMem_Free(counts);
    return result;
}

static PyMethodDef module_methods[] = {
    {"follow", follow, METH_VARARGS,
     "follow(occurrences, width, wraps, ends, stats, depth, shared, scale, p_min, min_reach, "
     "length) -> (tokens, confidences, cells): the suffix drafter's walk."},
    {"holding", holding, METH_VARARGS,
     "holding(items, order, key, entry): the (id, index) pairs but entry's that hold the "
     "context, in items' order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lookup_module = {
    PyModuleDef_HEAD_INIT, "_lookup",
    "The suffix drafter's token index in native code (token_index.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__lookup(void) {
    for (int k = 0; k < N_ORDERS; k++) {
        uint64_t power = 1;
        for (Py_ssize_t i = 0; i < ORDERS[k]; i++) power *= BASE;
        POWERS[k] = power;
    }
    ADD_NAME = PyUnicode_InternFromString("add");
    if (ADD_NAME == NULL || PyType_Ready(&TokenIndexType) < 0 ||
        PyType_Ready(&CalibrationType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&lookup_module);
    if (module == NULL) return NULL;
    PyObject *orders = Py_BuildValue("(nnnnnnn)", ORDERS[0], ORDERS[1], ORDERS[2], ORDERS[3],
                                     ORDERS[4], ORDERS[5], ORDERS[6]);
    if (orders == NULL || PyModule_AddObject(module, "ORDERS", orders) < 0 ||
        PyModule_AddIntConstant(module, "MAX_OCCURRENCES", MAX_OCCURRENCES) < 0 ||
        PyModule_AddObject(module, "BASE", PyLong_FromUnsignedLongLong(BASE)) < 0 ||
        PyModule_AddObjectRef(module, "TokenIndex", (PyObject *)&TokenIndexType) < 0 ||
        PyModule_AddObjectRef(module, "Calibration", (PyObject *)&CalibrationType) < 0) {
        Py_XDECREF(orders);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
