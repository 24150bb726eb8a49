/* kvmigrate._leafwalk.BlockRows: the rows of plain block files, kept in C.
 *
 * Included once, by _leafwalk.c. Why: a row the C walk took used to become sixteen
 * Python objects appended to sixteen lists, which Arrow then read back one object at a
 * time: on a 1M-file tree about 2.5 us of CPU per row, a quarter of a worker's time.
 * Here a row is one C struct; `arrays()` hands a task's rows to Arrow as column buffers
 * (no object per cell), `row(j)` and `set(j, ...)` serve the rare rows Python finishes
 * itself (a file to word, a target path already taken).
 *
 * Rows are numbered in the scan's Rows index space as -(j + 1) (Python rows count from 0),
 * so a block's row list (`blocks[(group, hex)]`) and the write order hold both kinds.
 *
 * The rows of the bucket being walked are also grouped here by block, (group, block
 * hash), in a small hash table: finish_blocks takes the blocks straight from it, and
 * only when Python rows join a bucket's blocks are they handed to the `blocks` dict
 * (export_blocks), in the order they were met.
 */

typedef struct {
    size_t tail;    /* offset of "<fanout>/<name>" in tails (NUL-terminated, ASCII) */
    uint32_t base;  /* index in bases: the relpath is bases[base] + tail */
    int32_t code, rank, group;
    int32_t status, action, reason; /* index in that column's values; -1: None */
    int has_hash;
    int carried; /* hash taken from the --baseline row (the file was not opened) */
    long long size, mtime_ns, ctime_ns;
    unsigned long long ino, dev;
    unsigned long nlink;
    unsigned char digest[16];
} BRow;

enum { V_STATUS, V_ACTION, V_REASON, N_VALUE_COLUMNS };

typedef struct {
    PyObject_HEAD
    BRow *rows;
    PyObject **targets; /* per row: a str, or NULL for None */
    Py_ssize_t n, cap;
    char *tails;
    size_t tlen, tcap;
    Py_ssize_t *next;    /* per row: the next row of its block in this bucket, or -1 */
    Py_ssize_t *slots;   /* open addressing over (group, name): a block's first row, or -1 */
    Py_ssize_t *lasts;   /* per slot: the block's last row */
    size_t *heads;       /* the slots in use, in the order their blocks were met */
    size_t nslots, nheads;
    PyObject *bases;                     /* list of relbase strs */
    PyObject *values[N_VALUE_COLUMNS];   /* lists: the distinct status, action, reason values */
    PyObject *index[N_VALUE_COLUMNS];    /* dicts: value -> its index in values */
} BlockRows;

static PyTypeObject BlockRowsType;

static int br_reserve(BlockRows *s, Py_ssize_t extra) {
    if (s->n + extra <= s->cap) return 0;
    Py_ssize_t cap = s->cap ? s->cap : 256;
    while (cap < s->n + extra) cap *= 2;
    BRow *rows = PyMem_Realloc(s->rows, sizeof(BRow) * (size_t)cap);
    if (!rows) {
        PyErr_NoMemory();
        return -1;
    }
    s->rows = rows;
    PyObject **targets = PyMem_Realloc(s->targets, sizeof(PyObject *) * (size_t)cap);
    if (!targets) {
        PyErr_NoMemory();
        return -1;
    }
    memset(targets + s->cap, 0, sizeof(PyObject *) * (size_t)(cap - s->cap));
    s->targets = targets;
    Py_ssize_t *next = PyMem_Realloc(s->next, sizeof(Py_ssize_t) * (size_t)cap);
    if (!next) {
        PyErr_NoMemory();
        return -1;
    }
    s->next = next;
    s->cap = cap;
    return 0;
}

/* Copy a NUL-terminated piece into tails; its offset, or (size_t)-1 (MemoryError set). */
static size_t br_tail(BlockRows *s, const char *fanout, const char *name) {
    size_t a = strlen(fanout), b = strlen(name), need = a + 1 + b + 1;
    if (s->tlen + need > s->tcap) {
        size_t cap = s->tcap ? s->tcap : 16384;
        while (cap < s->tlen + need) cap *= 2;
        char *p = PyMem_Realloc(s->tails, cap);
        if (!p) {
            PyErr_NoMemory();
            return (size_t)-1;
        }
        s->tails = p;
        s->tcap = cap;
    }
    char *p = s->tails + s->tlen;
    memcpy(p, fanout, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    s->tlen += need;
    return (size_t)(p - s->tails);
}

/* The index of `value` in column c's values (added if new); -1 for None, -2 on error. */
static int32_t br_value(BlockRows *s, int c, PyObject *value) {
    if (value == Py_None) return -1;
    PyObject *found = PyDict_GetItemWithError(s->index[c], value);
    if (found) return (int32_t)PyLong_AsLong(found);
    if (PyErr_Occurred()) return -2;
    Py_ssize_t k = PyList_GET_SIZE(s->values[c]);
    PyObject *key = PyLong_FromSsize_t(k);
    int rc = key ? PyDict_SetItem(s->index[c], value, key) : -1;
    Py_XDECREF(key);
    if (rc < 0 || PyList_Append(s->values[c], value) < 0) return -2;
    return (int32_t)k;
}

static PyObject *br_get_value(BlockRows *s, int c, int32_t k) {
    PyObject *v = k < 0 ? Py_None : PyList_GET_ITEM(s->values[c], k);
    Py_INCREF(v);
    return v;
}

/* The index of relbase in bases (the last one is reused: a walk_bucket call adds one). */
static int64_t br_base(BlockRows *s, PyObject *relbase) {
    Py_ssize_t k = PyList_GET_SIZE(s->bases);
    if (k && PyList_GET_ITEM(s->bases, k - 1) == relbase) return k - 1;
    if (k >= UINT32_MAX || PyList_Append(s->bases, relbase) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "too many rank folders in one task");
        return -1;
    }
    return k;
}

static PyObject *br_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "BlockRows() takes no arguments");
        return NULL;
    }
    BlockRows *s = (BlockRows *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    s->bases = PyList_New(0);
    int ok = s->bases != NULL;
    for (int c = 0; c < N_VALUE_COLUMNS && ok; c++) {
        s->values[c] = PyList_New(0);
        s->index[c] = PyDict_New();
        ok = s->values[c] && s->index[c];
    }
    if (!ok) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static void br_dealloc(BlockRows *s) {
    for (Py_ssize_t j = 0; j < s->n; j++) Py_XDECREF(s->targets[j]);
    PyMem_Free(s->rows);
    PyMem_Free(s->targets);
    PyMem_Free(s->next);
    PyMem_Free(s->slots);
    PyMem_Free(s->lasts);
    PyMem_Free(s->heads);
    PyMem_Free(s->tails);
    Py_XDECREF(s->bases);
    for (int c = 0; c < N_VALUE_COLUMNS; c++) {
        Py_XDECREF(s->values[c]);
        Py_XDECREF(s->index[c]);
    }
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static Py_ssize_t br_len(BlockRows *s) { return s->n; }

static int br_check(BlockRows *s, Py_ssize_t j) {
    if (j >= 0 && j < s->n) return 0;
    PyErr_SetString(PyExc_IndexError, "BlockRows: row out of range");
    return -1;
}

static const char *br_name(BlockRows *s, const BRow *r) { return strchr(s->tails + r->tail, '/') + 1; }

static PyObject *br_relpath(BlockRows *s, const BRow *r) {
    PyObject *tail = PyUnicode_FromString(s->tails + r->tail);
    if (!tail) return NULL;
    PyObject *path = PyUnicode_Concat(PyList_GET_ITEM(s->bases, r->base), tail);
    Py_DECREF(tail);
    return path;
}

static PyObject *block_hash(const char *name, size_t hexlen);

/* --- the blocks of the bucket being walked ---------------------------------------------- */

static size_t block_slot(int32_t group, const char *name, size_t mask) {
    return (size_t)XXH3_64bits_withSeed(name, strlen(name), (XXH64_hash_t)(uint32_t)group) & mask;
}

/* Room for one more block: the table is kept at most half full. */
static int br_slots_reserve(BlockRows *s) {
    if ((s->nheads + 1) * 2 <= s->nslots) return 0;
    size_t n = s->nslots ? s->nslots * 2 : 256;
    Py_ssize_t *slots = PyMem_Malloc(sizeof(Py_ssize_t) * n), *lasts = PyMem_Malloc(sizeof(Py_ssize_t) * n);
    size_t *heads = PyMem_Malloc(sizeof(size_t) * (n / 2));
    if (!slots || !lasts || !heads) {
        PyMem_Free(slots);
        PyMem_Free(lasts);
        PyMem_Free(heads);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < n; k++) slots[k] = -1;
    for (size_t q = 0; q < s->nheads; q++) { /* the blocks move over in the order they were met */
        size_t old = s->heads[q];
        const BRow *r = &s->rows[s->slots[old]];
        size_t k = block_slot(r->group, br_name(s, r), n - 1);
        while (slots[k] >= 0) k = (k + 1) & (n - 1);
        slots[k] = s->slots[old];
        lasts[k] = s->lasts[old];
        heads[q] = k;
    }
    PyMem_Free(s->slots);
    PyMem_Free(s->lasts);
    PyMem_Free(s->heads);
    s->slots = slots;
    s->lasts = lasts;
    s->heads = heads;
    s->nslots = n;
    return 0;
}

/* File row j under its block (a new block, or after the block's last row). */
static int br_block_add(BlockRows *s, Py_ssize_t j) {
    if (br_slots_reserve(s) < 0) return -1;
    const BRow *r = &s->rows[j];
    const char *name = br_name(s, r);
    size_t mask = s->nslots - 1;
    s->next[j] = -1;
    for (size_t k = block_slot(r->group, name, mask);; k = (k + 1) & mask) {
        Py_ssize_t h = s->slots[k];
        if (h < 0) {
            s->slots[k] = s->lasts[k] = j;
            s->heads[s->nheads++] = k;
            return 0;
        }
        if (s->rows[h].group == r->group && strcmp(br_name(s, &s->rows[h]), name) == 0) {
            s->next[s->lasts[k]] = j;
            s->lasts[k] = j;
            return 0;
        }
    }
}

static void br_blocks_clear(BlockRows *s) {
    for (size_t q = 0; q < s->nheads; q++) s->slots[s->heads[q]] = -1;
    s->nheads = 0;
}

/* The block key (group, hex) of row j: a new tuple. */
static PyObject *br_block_key(BlockRows *s, Py_ssize_t j) {
    const BRow *r = &s->rows[j];
    const char *name = br_name(s, r);
    return Py_BuildValue("(is#)", r->group, name, (Py_ssize_t)(strlen(name) - 4));
}

/* The rows of the block starting at row `head`, as a new list of indexes -(j + 1). */
static PyObject *br_block_rows(BlockRows *s, Py_ssize_t head) {
    PyObject *idx = PyList_New(0);
    for (Py_ssize_t j = head; idx && j >= 0; j = s->next[j]) {
        PyObject *i = PyLong_FromSsize_t(-(j + 1));
        if (!i || PyList_Append(idx, i) < 0) Py_CLEAR(idx);
        Py_XDECREF(i);
    }
    return idx;
}

/* Hand the blocks of this bucket to `blocks` ({(group, hex): [row indexes]}), each
 * block's rows after those already there; the table is empty afterwards. */
static int br_export(BlockRows *s, PyObject *blocks) {
    int rc = 0;
    for (size_t q = 0; q < s->nheads && rc == 0; q++) {
        Py_ssize_t head = s->slots[s->heads[q]];
        PyObject *key = br_block_key(s, head), *rows = key ? br_block_rows(s, head) : NULL;
        PyObject *idx = rows ? PyDict_GetItemWithError(blocks, key) : NULL;
        if (!rows) rc = -1;
        else if (idx) rc = PyList_SetSlice(idx, PyList_GET_SIZE(idx), PyList_GET_SIZE(idx), rows);
        else rc = PyErr_Occurred() ? -1 : PyDict_SetItem(blocks, key, rows);
        Py_XDECREF(key);
        Py_XDECREF(rows);
    }
    br_blocks_clear(s);
    return rc;
}

PyDoc_STRVAR(br_export_doc,
"export_blocks(blocks): hand the blocks of the bucket walked so far to the dict\n"
"{(group, hex): [row indexes]} (each block's rows after those already there), before\n"
"Python rows join the same blocks.");

static PyObject *br_export_blocks(BlockRows *s, PyObject *blocks) {
    if (!PyDict_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks: a dict expected");
        return NULL;
    }
    if (br_export(s, blocks) < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(br_row_doc, "row(j) -> the 16 values of row j in ROW_COLUMNS order (as the column lists hold them).");

static PyObject *br_row(BlockRows *s, PyObject *arg) {
    Py_ssize_t j = PyLong_AsSsize_t(arg);
    if ((j == -1 && PyErr_Occurred()) || br_check(s, j) < 0) return NULL;
    const BRow *r = &s->rows[j];
    const char *name = br_name(s, r);
    PyObject *target = s->targets[j] ? s->targets[j] : Py_None;
    /* (ROW_COLUMNS order: relpath ns rank group block_hash size mtime_ns inode dev nlink content payload
     * status action reason target) */
    return Py_BuildValue("(NiiiNLLKKkNON NNO)", br_relpath(s, r), r->code, r->rank, r->group,
                         block_hash(name, strlen(name) - 4), r->size, r->mtime_ns, r->ino, r->dev, r->nlink,
                         r->has_hash ? PyBytes_FromStringAndSize((const char *)r->digest, 16) : Py_NewRef(Py_None),
                         Py_None, br_get_value(s, V_STATUS, r->status), br_get_value(s, V_ACTION, r->action),
                         br_get_value(s, V_REASON, r->reason), target);
}

static int br_set_row(BlockRows *s, Py_ssize_t j, PyObject *status, PyObject *action, PyObject *reason) {
    int32_t a = br_value(s, V_STATUS, status), b = br_value(s, V_ACTION, action), c = br_value(s, V_REASON, reason);
    if (a < -1 || b < -1 || c < -1) return -1;
    s->rows[j].status = a;
    s->rows[j].action = b;
    s->rows[j].reason = c;
    return 0;
}

static void br_set_target(BlockRows *s, Py_ssize_t j, PyObject *target) {
    PyObject *old = s->targets[j];
    s->targets[j] = target == Py_None ? NULL : Py_NewRef(target);
    Py_XDECREF(old);
}

PyDoc_STRVAR(br_set_doc, "set(j, status, action, reason, target): row j's verdict (what Python decided for it).");

static PyObject *br_set(BlockRows *s, PyObject *args) {
    Py_ssize_t j;
    PyObject *status, *action, *reason, *target;
    if (!PyArg_ParseTuple(args, "nOOOO", &j, &status, &action, &reason, &target) || br_check(s, j) < 0) return NULL;
    if (target != Py_None && !PyUnicode_Check(target)) {
        PyErr_SetString(PyExc_TypeError, "target: str or None expected");
        return NULL;
    }
    if (br_set_row(s, j, status, action, reason) < 0) return NULL;
    br_set_target(s, j, target);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(br_extend_doc, "extend(other): append other's rows (their indexes shift by len(self)).");

static PyObject *br_extend(BlockRows *s, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &BlockRowsType)) {
        PyErr_SetString(PyExc_TypeError, "BlockRows expected");
        return NULL;
    }
    BlockRows *o = (BlockRows *)arg;
    if (o == s || s->nheads || o->nheads) {
        PyErr_SetString(PyExc_ValueError, o == s ? "BlockRows cannot extend itself"
                                                 : "BlockRows: a bucket's blocks are not finished");
        return NULL;
    }
    int32_t *remap[N_VALUE_COLUMNS] = {0};
    PyObject *result = NULL;
    Py_ssize_t nbases = PyList_GET_SIZE(s->bases);
    if (br_reserve(s, o->n) < 0) goto out;
    for (int c = 0; c < N_VALUE_COLUMNS; c++) {
        Py_ssize_t k = PyList_GET_SIZE(o->values[c]);
        remap[c] = PyMem_Malloc(sizeof(int32_t) * (size_t)(k ? k : 1));
        if (!remap[c]) {
            PyErr_NoMemory();
            goto out;
        }
        for (Py_ssize_t v = 0; v < k; v++)
            if ((remap[c][v] = br_value(s, c, PyList_GET_ITEM(o->values[c], v))) < -1) goto out;
    }
    for (Py_ssize_t b = 0; b < PyList_GET_SIZE(o->bases); b++)
        if (PyList_Append(s->bases, PyList_GET_ITEM(o->bases, b)) < 0) goto out;
    if (s->tlen + o->tlen > s->tcap) {
        size_t cap = s->tcap ? s->tcap : 16384;
        while (cap < s->tlen + o->tlen) cap *= 2;
        char *p = PyMem_Realloc(s->tails, cap);
        if (!p) {
            PyErr_NoMemory();
            goto out;
        }
        s->tails = p;
        s->tcap = cap;
    }
    if (o->tlen) memcpy(s->tails + s->tlen, o->tails, o->tlen);
    for (Py_ssize_t j = 0; j < o->n; j++) {
        BRow r = o->rows[j];
        r.tail += s->tlen;
        r.base += (uint32_t)nbases;
        r.status = r.status < 0 ? -1 : remap[V_STATUS][r.status];
        r.action = r.action < 0 ? -1 : remap[V_ACTION][r.action];
        r.reason = r.reason < 0 ? -1 : remap[V_REASON][r.reason];
        s->rows[s->n] = r;
        s->targets[s->n] = o->targets[j] ? Py_NewRef(o->targets[j]) : NULL;
        s->n++;
    }
    s->tlen += o->tlen;
    result = Py_NewRef(Py_None);
out:
    for (int c = 0; c < N_VALUE_COLUMNS; c++) PyMem_Free(remap[c]);
    return result;
}

/* A validity bitmap (Arrow: bit j set = row j valid) for rows where valid(j); Py_None
 * when every row is valid. */
#define BITMAP(n) PyBytes_FromStringAndSize(NULL, ((n) + 7) / 8)

static PyObject *br_codes(BlockRows *s, const Py_ssize_t *sel, Py_ssize_t n, int c, PyObject **validity) {
    PyObject *codes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int32_t) * (n ? n : 1));
    PyObject *bits = BITMAP(n ? n : 1);
    if (!codes || !bits) {
        Py_XDECREF(codes);
        Py_XDECREF(bits);
        return NULL;
    }
    int32_t *out = (int32_t *)PyBytes_AS_STRING(codes);
    unsigned char *b = (unsigned char *)PyBytes_AS_STRING(bits);
    memset(b, 0, (size_t)PyBytes_GET_SIZE(bits));
    int nulls = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        const BRow *r = &s->rows[sel[j]];
        int32_t k = c == V_STATUS ? r->status : c == V_ACTION ? r->action : r->reason;
        out[j] = k < 0 ? 0 : k;
        if (k < 0) nulls = 1;
        else b[j >> 3] |= (unsigned char)(1u << (j & 7));
    }
    if (!nulls) Py_SETREF(bits, Py_NewRef(Py_None));
    *validity = bits;
    return codes;
}

PyDoc_STRVAR(br_arrays_doc,
"arrays(base_utf8, order=None) -> dict of Arrow column buffers (bytes) for the rows.\n"
"\n"
"`order`: the row indexes -(j + 1) to take, in output order (None: every row, in store\n"
"order): the write order is gathered here, with no Arrow `take` afterwards.\n"
"`base_utf8`: per entry of `bases`, its UTF-8 bytes as the manifest shows it. Keys:\n"
"relpath_offsets/relpath_data (int32 offsets), ns, rank, group (int32), hash_offsets/\n"
"hash_data, size, mtime_ns (int64), inode, dev (uint64), nlink (uint32), content (16\n"
"bytes a row) and content_valid, status/action/reason (int32 indexes into `values(c)`)\n"
"with *_valid, target_offsets/target_data/target_valid (target_* None: a target path is\n"
"not valid UTF-8; build that column from targets()). A *_valid of None: no nulls.");

#define NEW_BUF(type, count) PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof(type) * (size_t)((count) ? (count) : 1)))

static int put(PyObject *d, const char *key, PyObject *value) {
    if (!value) return -1;
    int rc = PyDict_SetItemString(d, key, value);
    Py_DECREF(value);
    return rc;
}

/* The rows to output, as store indexes: those of `order` (indexes -(j + 1)), or all. */
static Py_ssize_t *br_selection(BlockRows *s, PyObject *order, Py_ssize_t *count) {
    Py_ssize_t n = order == Py_None ? s->n : PyList_GET_SIZE(order);
    Py_ssize_t *sel = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (!sel) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t p = 0; p < n; p++) {
        if (order == Py_None) {
            sel[p] = p;
            continue;
        }
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(order, p));
        if ((i == -1 && PyErr_Occurred()) || i >= 0 || -i - 1 >= s->n) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "order: indexes -(j + 1) of rows in the store expected");
            PyMem_Free(sel);
            return NULL;
        }
        sel[p] = -i - 1;
    }
    *count = n;
    return sel;
}

static PyObject *br_arrays(BlockRows *s, PyObject *args) {
    PyObject *base_utf8, *order = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &base_utf8, &order)) return NULL;
    if (order != Py_None && !PyList_Check(order)) {
        PyErr_SetString(PyExc_TypeError, "order: a list or None expected");
        return NULL;
    }
    if (!PyList_Check(base_utf8) || PyList_GET_SIZE(base_utf8) != PyList_GET_SIZE(s->bases)) {
        PyErr_SetString(PyExc_ValueError, "base_utf8: one bytes per base expected");
        return NULL;
    }
    for (Py_ssize_t b = 0; b < PyList_GET_SIZE(base_utf8); b++)
        if (!PyBytes_Check(PyList_GET_ITEM(base_utf8, b))) {
            PyErr_SetString(PyExc_TypeError, "base_utf8: bytes expected");
            return NULL;
        }
    Py_ssize_t n;
    Py_ssize_t *sel = br_selection(s, order, &n);
    if (!sel) return NULL;
    PyObject *d = PyDict_New();
    if (!d) {
        PyMem_Free(sel);
        return NULL;
    }
    /* relpath and block hash: offsets, then the bytes */
    size_t rel_bytes = 0, hash_bytes = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        const BRow *r = &s->rows[sel[j]];
        const char *name = br_name(s, r);
        rel_bytes += (size_t)PyBytes_GET_SIZE(PyList_GET_ITEM(base_utf8, r->base)) + strlen(s->tails + r->tail);
        hash_bytes += (strlen(name) - 4) / 2;
    }
    if (rel_bytes > INT32_MAX || hash_bytes > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "BlockRows: more than 2 GiB of paths in one task");
        Py_DECREF(d);
        PyMem_Free(sel);
        return NULL;
    }
    PyObject *rel_off = NEW_BUF(int32_t, n + 1), *rel_data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)rel_bytes);
    PyObject *h_off = NEW_BUF(int32_t, n + 1), *h_data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)hash_bytes);
    PyObject *ns = NEW_BUF(int32_t, n), *rank = NEW_BUF(int32_t, n), *group = NEW_BUF(int32_t, n);
    PyObject *size = NEW_BUF(int64_t, n), *mtime = NEW_BUF(int64_t, n), *ino = NEW_BUF(uint64_t, n);
    PyObject *dev = NEW_BUF(uint64_t, n), *nlink = NEW_BUF(uint32_t, n), *content = NEW_BUF(char[16], n);
    PyObject *content_valid = BITMAP(n ? n : 1);
    PyObject *ctime = NEW_BUF(int64_t, n), *carried = BITMAP(n ? n : 1);
    PyObject *all[] = {rel_off, rel_data, h_off, h_data, ns, rank, group, size, mtime, ino, dev, nlink, content,
                       content_valid, ctime, carried};
    const char *keys[] = {"relpath_offsets", "relpath_data", "hash_offsets", "hash_data", "ns", "rank", "group",
                          "size", "mtime_ns", "inode", "dev", "nlink", "content", "content_valid", "ctime_ns",
                          "carried"};
    int ok = 1;
    for (size_t k = 0; k < sizeof all / sizeof *all; k++) ok = ok && all[k];
    if (ok) {
        int32_t *ro = (int32_t *)PyBytes_AS_STRING(rel_off), *ho = (int32_t *)PyBytes_AS_STRING(h_off);
        char *rd = PyBytes_AS_STRING(rel_data);
        unsigned char *hd = (unsigned char *)PyBytes_AS_STRING(h_data);
        unsigned char *cv = (unsigned char *)PyBytes_AS_STRING(content_valid);
        memset(cv, 0, (size_t)PyBytes_GET_SIZE(content_valid));
        unsigned char *cb = (unsigned char *)PyBytes_AS_STRING(carried);
        memset(cb, 0, (size_t)PyBytes_GET_SIZE(carried));
        size_t rpos = 0, hpos = 0;
        int hashed_all = 1;
        ro[0] = ho[0] = 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            const BRow *r = &s->rows[sel[j]];
            PyObject *base = PyList_GET_ITEM(base_utf8, r->base);
            const char *tail = s->tails + r->tail, *name = br_name(s, r);
            size_t bl = (size_t)PyBytes_GET_SIZE(base), tl = strlen(tail), hl = strlen(name) - 4;
            memcpy(rd + rpos, PyBytes_AS_STRING(base), bl);
            memcpy(rd + rpos + bl, tail, tl);
            rpos += bl + tl;
            ro[j + 1] = (int32_t)rpos;
            for (size_t i = 0; i < hl; i += 2) hd[hpos++] = (unsigned char)(hex_value(name[i]) << 4 | hex_value(name[i + 1]));
            ho[j + 1] = (int32_t)hpos;
            ((int32_t *)PyBytes_AS_STRING(ns))[j] = r->code;
            ((int32_t *)PyBytes_AS_STRING(rank))[j] = r->rank;
            ((int32_t *)PyBytes_AS_STRING(group))[j] = r->group;
            ((int64_t *)PyBytes_AS_STRING(size))[j] = r->size;
            ((int64_t *)PyBytes_AS_STRING(mtime))[j] = r->mtime_ns;
            ((int64_t *)PyBytes_AS_STRING(ctime))[j] = r->ctime_ns;
            if (r->carried) cb[j >> 3] |= (unsigned char)(1u << (j & 7));
            ((uint64_t *)PyBytes_AS_STRING(ino))[j] = r->ino;
            ((uint64_t *)PyBytes_AS_STRING(dev))[j] = r->dev;
            ((uint32_t *)PyBytes_AS_STRING(nlink))[j] = (uint32_t)r->nlink;
            unsigned char *c = (unsigned char *)PyBytes_AS_STRING(content) + 16 * j;
            if (r->has_hash) {
                memcpy(c, r->digest, 16);
                cv[j >> 3] |= (unsigned char)(1u << (j & 7));
            } else {
                memset(c, 0, 16);
                hashed_all = 0;
            }
        }
        if (hashed_all) {
            Py_SETREF(all[13], Py_NewRef(Py_None));
            content_valid = all[13];
        }
    }
    for (size_t k = 0; k < sizeof all / sizeof *all; k++) {
        if (ok) ok = put(d, keys[k], all[k]) == 0;
        else Py_XDECREF(all[k]);
    }
    const char *names[N_VALUE_COLUMNS] = {"status", "action", "reason"};
    char vkey[32];
    for (int c = 0; c < N_VALUE_COLUMNS && ok; c++) {
        PyObject *valid = NULL, *codes = br_codes(s, sel, n, c, &valid);
        snprintf(vkey, sizeof vkey, "%s_valid", names[c]);
        ok = put(d, names[c], codes) == 0 && put(d, vkey, valid) == 0;
    }
    if (ok) { /* target paths: UTF-8 of each str, or the whole column from targets() */
        size_t tbytes = 0;
        int utf8 = 1;
        for (Py_ssize_t j = 0; j < n && utf8; j++) {
            Py_ssize_t len = 0;
            PyObject *target = s->targets[sel[j]];
            if (target && !PyUnicode_AsUTF8AndSize(target, &len)) {
                PyErr_Clear(); /* (a lone surrogate) */
                utf8 = 0;
            }
            tbytes += (size_t)len;
        }
        if (!utf8 || tbytes > INT32_MAX) {
            ok = put(d, "target_offsets", Py_NewRef(Py_None)) == 0 && put(d, "target_data", Py_NewRef(Py_None)) == 0 &&
                 put(d, "target_valid", Py_NewRef(Py_None)) == 0;
        } else {
            PyObject *t_off = NEW_BUF(int32_t, n + 1), *t_data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)tbytes);
            PyObject *t_valid = BITMAP(n ? n : 1);
            if (t_off && t_data && t_valid) {
                int32_t *to = (int32_t *)PyBytes_AS_STRING(t_off);
                unsigned char *tv = (unsigned char *)PyBytes_AS_STRING(t_valid);
                memset(tv, 0, (size_t)PyBytes_GET_SIZE(t_valid));
                size_t pos = 0;
                to[0] = 0;
                for (Py_ssize_t j = 0; j < n; j++) {
                    PyObject *target = s->targets[sel[j]];
                    if (target) {
                        Py_ssize_t len;
                        const char *u = PyUnicode_AsUTF8AndSize(target, &len);
                        memcpy(PyBytes_AS_STRING(t_data) + pos, u, (size_t)len);
                        pos += (size_t)len;
                        tv[j >> 3] |= (unsigned char)(1u << (j & 7));
                    }
                    to[j + 1] = (int32_t)pos;
                }
            }
            ok = put(d, "target_offsets", t_off) == 0 && put(d, "target_data", t_data) == 0 &&
                 put(d, "target_valid", t_valid) == 0;
        }
    }
    PyMem_Free(sel);
    if (!ok) Py_CLEAR(d);
    return d;
}

PyDoc_STRVAR(br_values_doc, "values(c) -> the distinct values of column c (0 status, 1 action, 2 reason), in index order.");

static PyObject *br_values(BlockRows *s, PyObject *arg) {
    long c = PyLong_AsLong(arg);
    if (c == -1 && PyErr_Occurred()) return NULL;
    if (c < 0 || c >= N_VALUE_COLUMNS) {
        PyErr_SetString(PyExc_ValueError, "values: 0, 1 or 2 expected");
        return NULL;
    }
    return PyList_GetSlice(s->values[c], 0, PyList_GET_SIZE(s->values[c]));
}

PyDoc_STRVAR(br_targets_doc, "targets(order=None) -> the target column (str or None) of the rows arrays() takes.");

static PyObject *br_targets(BlockRows *s, PyObject *args) {
    PyObject *order = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &order)) return NULL;
    if (order != Py_None && !PyList_Check(order)) {
        PyErr_SetString(PyExc_TypeError, "order: a list or None expected");
        return NULL;
    }
    Py_ssize_t n;
    Py_ssize_t *sel = br_selection(s, order, &n);
    if (!sel) return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t j = 0; out && j < n; j++) {
        PyObject *target = s->targets[sel[j]];
        PyList_SET_ITEM(out, j, Py_NewRef(target ? target : Py_None));
    }
    PyMem_Free(sel);
    return out;
}

static PyObject *br_bases(BlockRows *s, void *unused) { return Py_NewRef(s->bases); }

PyDoc_STRVAR(br_carry_doc,
"carry(j0, dev, inode, size, mtime_ns, ctime_ns, content, check) -> [j]: the rows from\n"
"j0 on against the --baseline rows (kvmigrate.scan.baseline), sorted by inode.\n"
"\n"
"dev ... ctime_ns: buffers of 8-byte values, content one of 16 bytes a row. check false:\n"
"a row whose five stat fields equal a baseline row's takes its hash (carried over, never\n"
"opened); returns the rows that must be read. check true (rows just hashed): returns the\n"
"rows whose stat fields are unchanged but whose hash differs (a silent change).");

static PyObject *br_carry(BlockRows *s, PyObject *args) {
    Py_ssize_t j0;
    Py_buffer b[6];
    int check;
    if (!PyArg_ParseTuple(args, "ny*y*y*y*y*y*p", &j0, &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &check))
        return NULL;
    Py_ssize_t nb = b[0].len / 8;
    PyObject *out = NULL;
    for (int k = 1; k < 5; k++)
        if (b[k].len / 8 != nb) goto done;
    if (b[5].len / 16 != nb) goto done;
    const uint64_t *dev = (const uint64_t *)b[0].buf, *ino = (const uint64_t *)b[1].buf;
    const int64_t *size = (const int64_t *)b[2].buf, *mtime = (const int64_t *)b[3].buf;
    const int64_t *ctime = (const int64_t *)b[4].buf;
    const unsigned char *content = (const unsigned char *)b[5].buf;
    out = PyList_New(0);
    for (Py_ssize_t j = j0 < 0 ? 0 : j0; out && j < s->n; j++) {
        BRow *r = &s->rows[j];
        Py_ssize_t lo = 0, hi = nb; /* the first baseline row with this inode */
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (ino[mid] < r->ino) lo = mid + 1;
            else hi = mid;
        }
        Py_ssize_t found = -1;
        for (Py_ssize_t i = lo; i < nb && ino[i] == r->ino && found < 0; i++)
            if (dev[i] == r->dev && size[i] == r->size && mtime[i] == r->mtime_ns && ctime[i] == r->ctime_ns)
                found = i;
        int differs = 0;
        if (found >= 0 && !check) {
            memcpy(r->digest, content + 16 * found, 16);
            r->has_hash = 1;
            r->carried = 1;
        }
        if (found >= 0 && check) differs = r->has_hash && memcmp(r->digest, content + 16 * found, 16) != 0;
        if (check ? differs : found < 0) {
            PyObject *jj = PyLong_FromSsize_t(j);
            if (!jj || PyList_Append(out, jj) < 0) Py_CLEAR(out);
            Py_XDECREF(jj);
        }
    }
done:
    if (!out && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "carry: baseline columns of unequal length");
    for (int k = 0; k < 6; k++) PyBuffer_Release(&b[k]);
    return out;
}

PyDoc_STRVAR(br_set_content_doc, "set_content(j, digest): row j's content hash (16 bytes), read by Python.");

static PyObject *br_set_content(BlockRows *s, PyObject *args) {
    Py_ssize_t j;
    const char *digest;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "ny#", &j, &digest, &len)) return NULL;
    if (br_check(s, j) < 0) return NULL;
    if (len != 16) {
        PyErr_SetString(PyExc_ValueError, "set_content: a 16-byte digest expected");
        return NULL;
    }
    memcpy(s->rows[j].digest, digest, 16);
    s->rows[j].has_hash = 1;
    Py_RETURN_NONE;
}

static PyMethodDef br_methods[] = {
    {"carry", (PyCFunction)br_carry, METH_VARARGS, br_carry_doc},
    {"set_content", (PyCFunction)br_set_content, METH_VARARGS, br_set_content_doc},
    {"row", (PyCFunction)br_row, METH_O, br_row_doc},
    {"export_blocks", (PyCFunction)br_export_blocks, METH_O, br_export_doc},
    {"set", (PyCFunction)br_set, METH_VARARGS, br_set_doc},
    {"extend", (PyCFunction)br_extend, METH_O, br_extend_doc},
    {"arrays", (PyCFunction)br_arrays, METH_VARARGS, br_arrays_doc},
    {"values", (PyCFunction)br_values, METH_O, br_values_doc},
    {"targets", (PyCFunction)br_targets, METH_VARARGS, br_targets_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef br_getset[] = {
    {"bases", (getter)br_bases, NULL, "the relbase strs rows point at (relpath = base + tail)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods br_as_sequence = {.sq_length = (lenfunc)br_len};

static PyTypeObject BlockRowsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvmigrate._leafwalk.BlockRows",
    .tp_basicsize = sizeof(BlockRows),
    .tp_dealloc = (destructor)br_dealloc,
    .tp_as_sequence = &br_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Rows of plain block files the C walk took, one C struct each (see _blockrows.h).",
    .tp_methods = br_methods,
    .tp_getset = br_getset,
    .tp_new = br_new,
};
