/* kvmigrate._leafwalk: the healthy-block leaf loop of `scan` in C (optional).
 *
 * Why: a real cache holds millions of small block files; the Python walk spends about
 * 9 us of interpreter time per file (DirEntry objects, regex, open/fstat/read calls,
 * row appends), which puts `scan --verify hash` behind `xxhsum`. This module walks ONE
 * bucket folder (`<rank folder>/<hhh>`) of one rank folder: every `<hh>_g<group>`
 * fan-out folder in it and every `<even hex>.bin` file in those, by file descriptor
 * (openat/fstatat: no path lookups, no symlink ever followed), with the GIL released,
 * and hashes each file with XXH3-128 (the vendored xxHash library, the same code the
 * `xxhash` package runs). Then, holding the GIL, it appends one manifest row per file
 * to the task's BlockRows (_blockrows.h: one C struct a row, no Python object) and files
 * it under its block there; `finish_blocks` gives each block its verdict.
 *
 * It only takes the plain case: a regular, non-empty, readable file with a well-formed
 * name in the right fan-out folder, whose size and bytes did not change while read.
 * Everything else (foreign files, symlinks, misfiled blocks, errors to word, empty or
 * zero-filled files, growing files) is returned to the Python walker as an "unusual"
 * entry, which words it exactly as it always has. Files that vanish meanwhile (ENOENT,
 * or replaced by a symlink / FIFO / non-file) are dropped, as the Python walker drops
 * them. Nothing is ever opened for writing.
 *
 * kvmigrate/scan/walker.py falls back to the Python walk when this extension is absent
 * (it is built only where a C compiler is found) or KVMIGRATE_PURE_PYTHON=1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef __linux__
#error "the leaf walk reads directories with getdents64 (Linux); elsewhere scan uses its Python walk"
#endif

#include <dirent.h>
#include <errno.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/mman.h>
#include <unistd.h>

#include "xxhash.h"
#ifdef KVMIGRATE_XXH_X86_DISPATCH /* x86: SSE2, AVX2 or AVX-512, chosen at run time by the CPU */
#include "xxh_x86dispatch.h"
#endif

#if !defined(O_NOATIME) || !defined(O_CLOEXEC) /* (Python.h asks for _GNU_SOURCE) */
#error "O_NOATIME and O_CLOEXEC are needed: evictors judge a block's age by its atime"
#endif

/* The row columns, in the order of kvmigrate/scan/rows.py Rows.COLUMNS: `finish_blocks`
 * takes the column lists in this order and `BlockRows.row(j)` returns a row in it. The
 * module exports the names as ROW_COLUMNS; tests/test_leaf_walk.py asserts they equal
 * Rows.COLUMNS, so the two sides cannot drift apart silently. */
enum { COL_RELPATH, COL_NS, COL_RANK, COL_GROUP, COL_BLOCK_HASH, COL_SIZE, COL_MTIME_NS, COL_INODE, COL_DEV,
       COL_NLINK, COL_CONTENT, COL_PAYLOAD, COL_STATUS, COL_ACTION, COL_REASON, COL_TARGET, N_COLUMNS };
static const char *const ROW_COLUMNS[N_COLUMNS] = {
    "relpath", "ns", "rank", "group", "block_hash", "size", "mtime_ns", "inode", "dev",
    "nlink", "content", "payload", "status", "action", "reason", "target"};
#define MAX_GROUP_DIGITS 9

/* --- growable C storage filled without the GIL -------------------------------------- */

typedef struct {
    char *data;
    size_t len, cap;
} Names; /* NUL-separated names; records hold offsets */

typedef struct {
    int fanout;        /* index in fanouts */
    size_t name;       /* offset of the file name in names */
    int group;
    int has_hash;
    long long size, mtime_ns, ctime_ns;
    unsigned long long ino, dev;
    unsigned long nlink;
    unsigned char digest[16];
} Record;

typedef struct {
    size_t name; /* offset in names */
    int group;
} Fanout; /* a fan-out folder the walk listed */

typedef struct {
    int fanout; /* index in fanouts, or -1: an entry of the bucket folder itself */
    size_t name;
} Odd; /* an entry handed back to the Python walker */

typedef struct {
    Names names;
    Record *recs;
    size_t nrecs, caprecs;
    Fanout *fanouts;
    size_t nfan, capfan;
    Odd *odds;
    size_t nodd, capodd;
    int failed; /* out of memory */
} Walk;

/* Room for element `len` of a growable array; 0 (and w->failed) when out of memory. */
static int reserve(Walk *w, void **items, size_t *cap, size_t len, size_t size, size_t first) {
    if (len < *cap) return 1;
    size_t n = *cap ? *cap * 2 : first;
    void *p = realloc(*items, n * size);
    if (!p) {
        w->failed = 1;
        return 0;
    }
    *items = p;
    *cap = n;
    return 1;
}

/* A name copied into w->names (NUL-terminated; names are at most 255 bytes, so one
 * doubling from 8 KiB always makes room); its offset. */
static size_t names_add(Walk *w, const char *s) {
    size_t n = strlen(s) + 1;
    if (!reserve(w, (void **)&w->names.data, &w->names.cap, w->names.len + n - 1, 1, 8192)) return 0;
    memcpy(w->names.data + w->names.len, s, n);
    w->names.len += n;
    return w->names.len - n;
}

static Record *rec_new(Walk *w) {
    if (!reserve(w, (void **)&w->recs, &w->caprecs, w->nrecs, sizeof(Record), 256)) return NULL;
    return &w->recs[w->nrecs++];
}

static int fanout_add(Walk *w, const char *name, int group) {
    if (!reserve(w, (void **)&w->fanouts, &w->capfan, w->nfan, sizeof(Fanout), 64)) return -1;
    size_t off = names_add(w, name);
    if (w->failed) return -1;
    w->fanouts[w->nfan] = (Fanout){off, group};
    return (int)w->nfan++;
}

static void odd_add(Walk *w, int fanout, const char *name) {
    if (!reserve(w, (void **)&w->odds, &w->capodd, w->nodd, sizeof(Odd), 16)) return;
    size_t off = names_add(w, name);
    if (w->failed) return;
    w->odds[w->nodd++] = (Odd){fanout, off};
}

static void walk_free(Walk *w) {
    free(w->names.data);
    free(w->recs);
    free(w->fanouts);
    free(w->odds);
}

/* --- names ------------------------------------------------------------------------------ */

static int is_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

/* `<hh>_g<digits>` (layout.FANOUT_RE, ASCII digits only, at most 9 of them: a longer
 * group goes back to the Python walker, which reads it with layout): the group, or -1.
 * These parsers are the grammar of kvmigrate/layout.py in C; tests/scan/test_leaf_walk.py
 * (test_both_walks_classify_every_name_as_the_layout_grammar) proves that on real files
 * with generated names. */
static int fanout_group(const char *s) {
    if (!is_hex(s[0]) || !is_hex(s[1]) || s[2] != '_' || s[3] != 'g' || !s[4]) return -1;
    long g = 0;
    int n = 0;
    for (const char *p = s + 4; *p; p++, n++) {
        if (*p < '0' || *p > '9' || n >= MAX_GROUP_DIGITS) return -1;
        g = g * 10 + (*p - '0');
    }
    return (int)g;
}

/* `<even number of hex digits, at least 6>.bin` (layout.BLOCK_RE): length of the hex
 * part, or 0. */
static size_t block_hex_len(const char *s) {
    size_t n = strlen(s);
    if (n < 10 || memcmp(s + n - 4, ".bin", 4) != 0) return 0;
    size_t h = n - 4;
    if (h & 1) return 0;
    for (size_t i = 0; i < h; i++)
        if (!is_hex(s[i])) return 0;
    return h;
}

/* --- files ------------------------------------------------------------------------------ */

enum { TAKEN, DROPPED, UNUSUAL };

/* Files from this size on are read and hashed a chunk at a time: with four walker threads
 * per core, whole 1 MiB reads evict each other's buffers from the core's cache before they
 * are hashed (a bare C loop over 4 GiB of 1 MiB files: 0.35 s whole, 0.335 s in 256 KiB
 * chunks). */
#define STREAM_CHUNK ((size_t)256 * 1024)

static int all_zero(const unsigned char *p, size_t n) {
    if (!n || p[0]) return n == 0;
    return memcmp(p, p + 1, n - 1) == 0;
}

static int open_block(int dirfd, const char *name) {
    int flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    int fd;
    do {
        fd = openat(dirfd, name, flags | O_NOATIME);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0 && errno == EPERM) { /* O_NOATIME needs ownership */
        do {
            fd = openat(dirfd, name, flags);
        } while (fd < 0 && errno == EINTR);
    }
    return fd;
}

static ssize_t read_full(int fd, unsigned char *buf, size_t want) {
    size_t got = 0;
    while (got < want) {
        ssize_t n = read(fd, buf + got, want - got);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (n == 0) break;
        got += (size_t)n;
    }
    return (ssize_t)got;
}

/* One read of `want` bytes where `expect` are left before EOF: a read that stops short of
 * `expect` is continued (not seen on local filesystems), so a short count proves EOF. */
static ssize_t read_block(int fd, unsigned char *buf, size_t want, size_t expect) {
    ssize_t n;
    do {
        n = read(fd, buf, want);
    } while (n < 0 && errno == EINTR);
    if (n > 0 && (size_t)n < want && (size_t)n < expect) {
        ssize_t more = read_full(fd, buf + n, want - (size_t)n);
        n = more < 0 ? -1 : n + more;
    }
    return n;
}

/* The row's stat fields; 0 when the mtime is beyond int64 nanoseconds (year 2262): the
 * Python walker says what it is. */
static int fill_stat(Record *rec, const struct stat *st) {
    if (st->st_mtim.tv_sec > 9000000000LL || st->st_mtim.tv_sec < -9000000000LL) return 0;
    rec->size = (long long)st->st_size;
    rec->mtime_ns = (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    rec->ctime_ns = (long long)st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec;
    rec->ino = (unsigned long long)st->st_ino;
    rec->dev = (unsigned long long)st->st_dev;
    rec->nlink = (unsigned long)st->st_nlink;
    return 1;
}

/* Is the file's first page in the page cache (someone read or wrote it lately)? Asked
 * with cachestat(2) (Linux 6.5), else mmap + mincore: neither starts a read (a read with
 * RWF_NOWAIT does, and a small file on a fast disk then looks cached). If neither can
 * tell: no (the pages read are let go). */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct kvm_cachestat_range { uint64_t off, len; };
struct kvm_cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };
static int cachestat_missing = 0;

static int first_page_cached(int fd) {
    if (!cachestat_missing) {
        struct kvm_cachestat_range range = {0, 4096};
        struct kvm_cachestat cs;
        if (syscall(__NR_cachestat, fd, &range, &cs, 0) == 0) return cs.nr_cache > 0;
        if (errno != ENOSYS) return 0;
        cachestat_missing = 1;
    }
    void *map = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return 0;
    unsigned char vec = 0;
    int cached = mincore(map, 4096, &vec) == 0 && (vec & 1);
    munmap(map, 4096);
    return cached;
}

/* Open, fstat and read one block file whole; fill rec (and `head`, when not NULL: its
 * first HEAD_BYTES bytes, or fewer when the file is shorter). */
#define HEAD_BYTES 4
static int hash_block(int dirfd, const char *name, unsigned char *buf, size_t buflen, Record *rec,
                      unsigned char *head) {
    int fd = open_block(dirfd, name);
    if (fd < 0) {
        if (errno == ENOENT || errno == ELOOP || errno == ENXIO || errno == ENOTDIR) return DROPPED;
        return UNUSUAL; /* permission, I/O: the Python walker words it */
    }
    struct stat st;
    int verdict = TAKEN;
    if (fstat(fd, &st) != 0) {
        verdict = UNUSUAL;
        goto done;
    }
    if (!S_ISREG(st.st_mode)) {
        verdict = DROPPED; /* replaced by a non-file meanwhile */
        goto done;
    }
    if (st.st_size <= 0) {
        verdict = UNUSUAL; /* empty: a finding */
        goto done;
    }
    if ((long long)st.st_blocks * 512 < (long long)st.st_size) {
        verdict = UNUSUAL; /* sparse (holes read as zeros: maybe a 1 TiB crash residue): the
                            * Python walker asks SEEK_DATA before it reads */
        goto done;
    }
    size_t size = (size_t)st.st_size;
    int cached = first_page_cached(fd);
    /* a file read in pieces: ask for all of it now, so the disk gets one large request
     * rather than a readahead window that grows read by read (cold 4 GiB of 1 MiB
     * files: 4.9 s against 5.6 s); a file already in the page cache is not asked for
     * again (the advice walks its pages for nothing) */
    if (size > STREAM_CHUNK && !cached) posix_fadvise(fd, 0, (off_t)size, POSIX_FADV_WILLNEED);
    size_t chunk = buflen - 1 < STREAM_CHUNK ? buflen - 1 : STREAM_CHUNK;
    XXH128_hash_t h = {0, 0};
    XXH3_state_t *state = NULL; /* only for files read in more than one piece */
    size_t total = 0;
    int zero = 1;
    for (;;) {
        size_t left = size - total;
        size_t want = left <= chunk ? left + 1 : chunk; /* the last read asks one byte more: */
        ssize_t n = read_block(fd, buf, want, left);    /* its short count proves EOF */
        if (n < 0 || (size_t)n > left) { /* an error, or it grew while read */
            verdict = UNUSUAL;
            break;
        }
        if (head && total == 0) memcpy(head, buf, (size_t)n < HEAD_BYTES ? (size_t)n : HEAD_BYTES);
        total += (size_t)n;
        if (!state && (size_t)n < want) { /* the whole file in one read: one-shot hash */
            h = XXH3_128bits(buf, (size_t)n);
            zero = all_zero(buf, (size_t)n);
            break;
        }
        if (!state) { /* in chunks that stay in the core's cache while they are hashed */
            state = XXH3_createState();
            if (!state) {
                verdict = UNUSUAL;
                break;
            }
            XXH3_128bits_reset(state);
        }
        XXH3_128bits_update(state, buf, (size_t)n);
        if (zero) zero = all_zero(buf, (size_t)n);
        if ((size_t)n < want) break; /* EOF */
    }
    if (state) {
        h = XXH3_128bits_digest(state);
        XXH3_freeState(state);
    }
    if (verdict == TAKEN && total != size) verdict = UNUSUAL; /* it shrank while read */
    if (verdict == TAKEN && zero) verdict = UNUSUAL; /* zero-filled: a finding */
    if (verdict == TAKEN && !fill_stat(rec, &st)) verdict = UNUSUAL;
    if (verdict == TAKEN) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, h);
        memcpy(rec->digest, c.digest, 16);
        rec->has_hash = 1;
    }
    /* what was read will not be needed again: let the pages go, so a hash scan of a big
     * cache does not evict the engine's hot pages; a file that was in the page cache
     * before (the engine's) stays there (kvmigrate.pacing.drop_cache) */
    if (!cached) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
done:
    close(fd);
    return verdict;
}

typedef struct {
    int check; /* --verify size as non-root: say when permission bits forbid reading */
    uid_t euid;
    gid_t *gids;
    size_t ngids;
} Perm;

static int may_read(const Perm *p, const struct stat *st) {
    if (p->euid == 0) return 1;
    if (st->st_uid == p->euid) return (st->st_mode & S_IRUSR) != 0;
    for (size_t i = 0; i < p->ngids; i++)
        if (p->gids[i] == st->st_gid) return (st->st_mode & S_IRGRP) != 0;
    return (st->st_mode & S_IROTH) != 0;
}

/* lstat one block file (--verify size / none: no read); fill rec. */
static int stat_block(int dirfd, const char *name, const Perm *perm, Record *rec) {
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return errno == ENOENT ? DROPPED : UNUSUAL;
    if (!S_ISREG(st.st_mode)) return UNUSUAL;
    if (perm->check && !may_read(perm, &st)) return UNUSUAL;
    if (!fill_stat(rec, &st)) return UNUSUAL;
    rec->has_hash = 0;
    return TAKEN;
}

/* Directory entries straight from getdents64: readdir's fdopendir costs an fstat and two
 * fcntl per folder, and a fan-out folder holds about one file. */
#define DIRBUF (32 * 1024)

typedef struct {
    int fd;
    char *buf;
    long len, pos;
    int error; /* errno of a failed getdents64 */
} Dir;

struct linux_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

static struct linux_dirent64 *dir_next(Dir *d) {
    if (d->pos >= d->len) {
        long n;
        do {
            n = syscall(SYS_getdents64, d->fd, d->buf, DIRBUF);
        } while (n < 0 && errno == EINTR);
        if (n <= 0) {
            d->error = n < 0 ? errno : 0;
            return NULL;
        }
        d->len = n;
        d->pos = 0;
    }
    struct linux_dirent64 *de = (struct linux_dirent64 *)(d->buf + d->pos);
    d->pos += de->d_reclen;
    return de;
}

/* d_type, or the lstat type where the filesystem does not say. */
static int entry_type(int dirfd, struct linux_dirent64 *de) {
    if (de->d_type != DT_UNKNOWN) return de->d_type;
    struct stat st;
    if (fstatat(dirfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) return DT_UNKNOWN;
    if (S_ISDIR(st.st_mode)) return DT_DIR;
    if (S_ISREG(st.st_mode)) return DT_REG;
    return DT_LNK; /* any other kind: not ours to take */
}

static int is_dot(const char *s) { return s[0] == '.' && (!s[1] || (s[1] == '.' && !s[2])); }

/* The files of one fan-out folder. */
static void walk_fanout(Walk *w, int bucketfd, const char *fname, int group, const char *hhh, int hashed,
                        const Perm *perm, unsigned char *buf, size_t buflen, char *dirbuf) {
    int fd = openat(bucketfd, fname, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT) odd_add(w, -1, fname); /* the Python walker words it */
        return;
    }
    int fi = fanout_add(w, fname, group);
    if (fi < 0) {
        close(fd);
        return;
    }
    size_t nrecs0 = w->nrecs, nodd0 = w->nodd;
    Dir d = {fd, dirbuf, 0, 0, 0};
    struct linux_dirent64 *de;
    while ((de = dir_next(&d)) != NULL) {
        const char *name = de->d_name;
        if (is_dot(name)) continue;
        size_t hexlen = entry_type(fd, de) == DT_REG ? block_hex_len(name) : 0;
        /* a block file in its right place starts with <hhh><hh> */
        if (!hexlen || memcmp(name, hhh, 3) != 0 || name[3] != fname[0] || name[4] != fname[1]) {
            odd_add(w, fi, name);
            if (w->failed) break;
            continue;
        }
        Record *rec = rec_new(w);
        if (!rec) break;
        rec->fanout = fi;
        rec->group = group;
        int v = hashed ? hash_block(fd, name, buf, buflen, rec, NULL) : stat_block(fd, name, perm, rec);
        if (v != TAKEN) {
            w->nrecs--;
            if (v == UNUSUAL) odd_add(w, fi, name);
            if (w->failed) break;
            continue;
        }
        rec->name = names_add(w, name);
        if (w->failed) break;
    }
    if (d.error && !w->failed) { /* cannot list it to the end: the Python walker lists it again and words it */
        w->nrecs = nrecs0;
        w->nodd = nodd0;
        odd_add(w, -1, fname);
    }
    close(fd);
}

/* The whole bucket folder: fan-out folders in it, their block files. */
static int walk_bucket_nogil(Walk *w, const char *bpath, const char *hhh, int hashed, const Perm *perm,
                             unsigned char *buf, size_t buflen) {
    char *dirbufs = malloc(2 * DIRBUF);
    if (!dirbufs) {
        w->failed = 1;
        return -1;
    }
    int bfd = open(bpath, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (bfd < 0) {
        free(dirbufs);
        return -1;
    }
    Dir d = {bfd, dirbufs, 0, 0, 0};
    struct linux_dirent64 *de;
    while ((de = dir_next(&d)) != NULL) {
        const char *name = de->d_name;
        if (is_dot(name)) continue;
        int group = fanout_group(name);
        if (group < 0 || entry_type(bfd, de) != DT_DIR) {
            odd_add(w, -1, name);
        } else {
            walk_fanout(w, bfd, name, group, hhh, hashed, perm, buf, buflen, dirbufs + DIRBUF);
        }
        if (w->failed) break;
    }
    close(bfd);
    free(dirbufs);
    return d.error ? -1 : 0; /* cannot list it: the Python walker says so */
}

/* --- the Python side ------------------------------------------------------------------ */

static int hex_value(char c) { return c <= '9' ? c - '0' : c - 'a' + 10; }

/* bytes.fromhex of the name's hex part (checked by block_hex_len). */
static PyObject *block_hash(const char *name, size_t hexlen) {
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(hexlen / 2));
    if (!b) return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(b);
    for (size_t i = 0; i < hexlen; i += 2) *p++ = (unsigned char)(hex_value(name[i]) << 4 | hex_value(name[i + 1]));
    return b;
}

#include "_blockrows.h"

PyDoc_STRVAR(walk_bucket_doc,
"walk_bucket(bucket_path, relbase, hhh, hashed, perm, code, rank, rows, verdict, buffer)\n"
"\n"
"Walk one bucket folder of one rank folder. Append a row per plain block file to `rows`\n"
"(a BlockRows; relpath = relbase + '<fanout>/<name>'), filed under its block (group,\n"
"hex) there until finish_blocks or rows.export_blocks. `perm` is None or (euid, gids) to check read\n"
"permission (--verify size as non-root); `verdict(group, size)` returns None or\n"
"(status, reason) (None: sizes are not checked). `buffer` is a writable bytearray\n"
"(read buffer). Returns None if the bucket folder cannot be opened or listed (the\n"
"caller walks it in Python), else the list of unusual entries (fanout, name): fanout\n"
"None for an entry of the bucket folder itself.");

static PyObject *walk_bucket(PyObject *self, PyObject *args) {
    PyObject *bpath_obj, *relbase, *hhh_obj, *perm_obj, *verdict, *buffer_obj;
    BlockRows *store;
    int hashed, code, rank;
    if (!PyArg_ParseTuple(args, "O&UUpOiiO!OO", PyUnicode_FSConverter, &bpath_obj, &relbase, &hhh_obj, &hashed,
                          &perm_obj, &code, &rank, &BlockRowsType, &store, &verdict, &buffer_obj))
        return NULL;
    PyObject *result = NULL;
    Py_buffer view = {0};
    Walk w;
    memset(&w, 0, sizeof w);
    Perm perm;
    memset(&perm, 0, sizeof perm);
    PyObject *s_ok = NULL, *s_none = NULL, *s_empty = NULL;
    PyObject *last_verdict = NULL;
    int32_t last_status = -1, last_reason = -1;
    int last_says = 0; /* the last verdict is (status, reason), not None */
    long long last_size = -1;
    int last_group = -1;

    const char *hhh = PyUnicode_AsUTF8(hhh_obj);
    if (!hhh) goto out;
    if (strlen(hhh) != 3) {
        PyErr_SetString(PyExc_ValueError, "hhh: a 3-character bucket name expected");
        goto out;
    }
    if (perm_obj != Py_None) {
        PyObject *gids_obj;
        unsigned long euid;
        if (!PyArg_ParseTuple(perm_obj, "kO", &euid, &gids_obj)) goto out;
        PyObject *seq = PySequence_Fast(gids_obj, "perm: (euid, gids) expected");
        if (!seq) goto out;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        perm.gids = malloc(sizeof(gid_t) * (size_t)(n ? n : 1));
        if (!perm.gids) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            goto out;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            unsigned long g = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
            if (g == (unsigned long)-1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                goto out;
            }
            perm.gids[i] = (gid_t)g;
        }
        Py_DECREF(seq);
        perm.ngids = (size_t)n;
        perm.euid = (uid_t)euid;
        perm.check = 1;
    }
    if (PyObject_GetBuffer(buffer_obj, &view, PyBUF_WRITABLE) < 0) goto out;
    if (view.len < 4096) {
        PyErr_SetString(PyExc_ValueError, "buffer: at least 4096 bytes expected");
        goto out;
    }

    int rc;
    const char *bpath = PyBytes_AS_STRING(bpath_obj);
    /* reads land on a 64-byte boundary: the kernel's copy into a misaligned buffer (a
     * bytearray's data starts 16 bytes into a line) is ~4% slower on 1 MiB files */
    size_t skew = (64 - (uintptr_t)view.buf % 64) % 64;
    unsigned char *buf = (unsigned char *)view.buf + skew;
    size_t buflen = (size_t)view.len - skew;
    Py_BEGIN_ALLOW_THREADS
    rc = walk_bucket_nogil(&w, bpath, hhh, hashed, &perm, buf, buflen);
    Py_END_ALLOW_THREADS
    if (w.failed) {
        PyErr_NoMemory();
        goto out;
    }
    if (rc < 0) {
        result = Py_None;
        Py_INCREF(result);
        goto out;
    }

    s_ok = PyUnicode_InternFromString("ok");
    s_none = PyUnicode_InternFromString("none");
    s_empty = PyUnicode_FromString("");
    if (!s_ok || !s_none || !s_empty) goto out;
    int32_t ok_code = br_value(store, V_STATUS, s_ok), none_code = br_value(store, V_ACTION, s_none);
    int32_t empty_code = br_value(store, V_REASON, s_empty);
    int64_t base = br_base(store, relbase);
    if (ok_code < 0 || none_code < 0 || empty_code < 0 || base < 0 || br_reserve(store, (Py_ssize_t)w.nrecs) < 0)
        goto out;
    int ok = 1;
    for (size_t r = 0; r < w.nrecs && ok; r++) {
        Record *rec = &w.recs[r];
        const char *name = w.names.data + rec->name;
        int32_t status = ok_code, reason = empty_code;
        if (verdict != Py_None) {
            if (rec->group != last_group || rec->size != last_size) {
                Py_XDECREF(last_verdict);
                last_verdict = PyObject_CallFunction(verdict, "iL", rec->group, rec->size);
                if (!last_verdict) { ok = 0; break; }
                last_group = rec->group;
                last_size = rec->size;
                last_says = last_verdict != Py_None;
                if (last_says) {
                    if (!PyTuple_Check(last_verdict) || PyTuple_GET_SIZE(last_verdict) != 2) {
                        PyErr_SetString(PyExc_TypeError, "verdict: None or (status, reason) expected");
                        ok = 0;
                        break;
                    }
                    last_status = br_value(store, V_STATUS, PyTuple_GET_ITEM(last_verdict, 0));
                    last_reason = br_value(store, V_REASON, PyTuple_GET_ITEM(last_verdict, 1));
                    if (last_status < -1 || last_reason < -1) { ok = 0; break; }
                }
            }
            if (last_says) {
                status = last_status;
                reason = last_reason;
            }
        }
        size_t tail = br_tail(store, w.names.data + w.fanouts[rec->fanout].name, name);
        if (tail == (size_t)-1) { ok = 0; break; }
        Py_ssize_t j = store->n++;
        store->rows[j] = (BRow){.tail = tail, .base = (uint32_t)base, .code = code, .rank = rank,
                                .group = rec->group, .status = status, .action = none_code, .reason = reason,
                                .has_hash = rec->has_hash, .size = rec->size, .mtime_ns = rec->mtime_ns,
                                .ctime_ns = rec->ctime_ns,
                                .ino = rec->ino, .dev = rec->dev, .nlink = rec->nlink};
        memcpy(store->rows[j].digest, rec->digest, 16);
        store->targets[j] = NULL;
        ok = br_block_add(store, j) == 0;
    }
    if (ok) {
        result = PyList_New((Py_ssize_t)w.nodd);
        for (size_t i = 0; result && i < w.nodd; i++) { /* (fan-out folder or None, name): rare, made here */
            const Odd *odd = &w.odds[i];
            PyObject *fan = odd->fanout < 0 ? Py_NewRef(Py_None)
                                            : PyUnicode_DecodeFSDefault(w.names.data + w.fanouts[odd->fanout].name);
            PyObject *nm = fan ? PyUnicode_DecodeFSDefault(w.names.data + odd->name) : NULL;
            PyObject *t = nm ? PyTuple_Pack(2, fan, nm) : NULL;
            Py_XDECREF(fan);
            Py_XDECREF(nm);
            if (!t) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, (Py_ssize_t)i, t);
        }
    }

out:
    Py_XDECREF(last_verdict);
    Py_XDECREF(s_ok);
    Py_XDECREF(s_none);
    Py_XDECREF(s_empty);
    if (view.obj) PyBuffer_Release(&view);
    free(perm.gids);
    walk_free(&w);
    Py_DECREF(bpath_obj);
    return result;
}

/* A block to finish, held for sorting in C: a key of the `blocks` dict, or a block of
 * the store's table (key NULL, its first row `head`). */
typedef struct {
    long group;
    const char *hex;
    Py_ssize_t len;
    PyObject *key; /* borrowed */
    Py_ssize_t head;
} KeyRef;

static int keyref_cmp(const void *a, const void *b) {
    const KeyRef *x = a, *y = b;
    if (x->group != y->group) return x->group < y->group ? -1 : 1;
    int c = memcmp(x->hex, y->hex, (size_t)(x->len < y->len ? x->len : y->len));
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* The blocks to finish in (group, hex) order: the keys of `blocks` when it has any (kept
 * alive in *keys), else the store's. Keys of an int and an ASCII str (every key the walks
 * make) are sorted by qsort, in the order Python's tuple comparison gives them (a
 * list.sort of 10^5 tuples a bucket costs a rich comparison per step); any other key
 * sends the whole list to list.sort. */
static KeyRef *sorted_blocks(PyObject *blocks, BlockRows *store, Py_ssize_t *count, PyObject **keys) {
    int from_dict = PyDict_GET_SIZE(blocks) > 0 || !store;
    Py_ssize_t n = from_dict ? PyDict_GET_SIZE(blocks) : (Py_ssize_t)store->nheads;
    KeyRef *refs = PyMem_Malloc(sizeof(KeyRef) * (size_t)(n ? n : 1));
    if (!refs) {
        PyErr_NoMemory();
        return NULL;
    }
    *count = n;
    *keys = NULL;
    if (!from_dict) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t head = store->slots[store->heads[i]];
            const BRow *r = &store->rows[head];
            const char *name = br_name(store, r);
            refs[i] = (KeyRef){r->group, name, (Py_ssize_t)strlen(name) - 4, NULL, head};
        }
        qsort(refs, (size_t)n, sizeof *refs, keyref_cmp);
        return refs;
    }
    *keys = PyDict_Keys(blocks);
    if (!*keys) {
        PyMem_Free(refs);
        return NULL;
    }
    int plain = 1;
    for (Py_ssize_t i = 0; i < n && plain; i++) {
        PyObject *key = PyList_GET_ITEM(*keys, i);
        if (!PyTuple_CheckExact(key) || PyTuple_GET_SIZE(key) != 2) {
            plain = 0;
            break;
        }
        PyObject *g = PyTuple_GET_ITEM(key, 0), *h = PyTuple_GET_ITEM(key, 1);
        int overflow = 0;
        long gv = PyLong_CheckExact(g) ? PyLong_AsLongAndOverflow(g, &overflow) : 0;
        if (!PyLong_CheckExact(g) || overflow || !PyUnicode_CheckExact(h) || !PyUnicode_IS_ASCII(h)) plain = 0;
        else refs[i] = (KeyRef){gv, (const char *)PyUnicode_1BYTE_DATA(h), PyUnicode_GET_LENGTH(h), key, -1};
    }
    if (plain) {
        qsort(refs, (size_t)n, sizeof *refs, keyref_cmp);
    } else {
        if (PyList_Sort(*keys) < 0) {
            Py_CLEAR(*keys);
            PyMem_Free(refs);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) refs[i] = (KeyRef){0, NULL, 0, PyList_GET_ITEM(*keys, i), -1};
    }
    return refs;
}

/* prefix + '<hhh>/<hh>_g<group>/<hex>.bin' (classify.target_relpath) from an ASCII
 * prefix: the bytes go straight into an ASCII str (PyUnicode_FromFormat parses its format
 * for every block). */
static PyObject *target_path_ascii(PyObject *prefix, long group, const char *h, Py_ssize_t hl) {
    char gs[24];
    int gl = snprintf(gs, sizeof gs, "%ld", group);
    Py_ssize_t a = PyUnicode_GET_LENGTH(prefix);
    PyObject *s = PyUnicode_New(a + 3 + 1 + 2 + 2 + gl + 1 + hl + 4, 127);
    if (!s) return NULL;
    char *p = (char *)PyUnicode_1BYTE_DATA(s);
    memcpy(p, PyUnicode_1BYTE_DATA(prefix), (size_t)a);
    p += a;
    memcpy(p, h, 3);
    p[3] = '/';
    memcpy(p + 4, h + 3, 2);
    memcpy(p + 6, "_g", 2);
    memcpy(p + 8, gs, (size_t)gl);
    p += 8 + gl;
    *p++ = '/';
    memcpy(p, h, (size_t)hl);
    memcpy(p + hl, ".bin", 4);
    return s;
}

/* The same from Python objects; a non-ASCII prefix goes through PyUnicode_FromFormat. */
static PyObject *target_path(PyObject *prefix, PyObject *group, PyObject *hex) {
    Py_ssize_t hl;
    const char *h = PyUnicode_AsUTF8AndSize(hex, &hl);
    if (!h) return NULL;
    if (hl < 5) {
        PyErr_SetString(PyExc_ValueError, "block hash too short");
        return NULL;
    }
    int overflow = 0;
    long g = PyLong_CheckExact(group) ? PyLong_AsLongAndOverflow(group, &overflow) : 0;
    if (!PyLong_CheckExact(group) || overflow || !PyUnicode_IS_ASCII(prefix) || !PyUnicode_IS_ASCII(hex))
        return PyUnicode_FromFormat("%U%.3s/%.2s_g%S/%U.bin", prefix, h, h + 3, group, hex);
    return target_path_ascii(prefix, g, h, hl);
}

/* The rows of a task: Python rows in the column lists (index i >= 0), C rows in a
 * BlockRows (index -(j + 1)). The accessors below read and write either kind. */
typedef struct {
    PyObject *P, *K, *Z, *C, *S, *A, *R, *T; /* relpath, rank, size, content, status, action, reason, target */
    BlockRows *store;                        /* NULL: no C rows */
    int32_t ok_code;                         /* the store's index of "ok" (-1: none yet) */
} Tab;

static BRow *c_row(Tab *t, Py_ssize_t i) { return i < 0 ? &t->store->rows[-i - 1] : NULL; }

static int row_in_range(Tab *t, Py_ssize_t i) {
    return i >= 0 ? i < PyList_GET_SIZE(t->S) : t->store && -i - 1 < t->store->n;
}

static int row_is_ok(Tab *t, Py_ssize_t i, PyObject *s_ok) {
    BRow *r = c_row(t, i);
    if (r) return r->status >= 0 && r->status == t->ok_code;
    PyObject *st = PyList_GET_ITEM(t->S, i);
    return st == s_ok || (PyUnicode_Check(st) && PyUnicode_Compare(st, s_ok) == 0);
}

/* Rank and size of row i as new references. */
static PyObject *row_rank(Tab *t, Py_ssize_t i) {
    BRow *r = c_row(t, i);
    return r ? PyLong_FromLong(r->rank) : Py_NewRef(PyList_GET_ITEM(t->K, i));
}

static PyObject *row_size(Tab *t, Py_ssize_t i) {
    BRow *r = c_row(t, i);
    return r ? PyLong_FromLongLong(r->size) : Py_NewRef(PyList_GET_ITEM(t->Z, i));
}

/* What replicas are compared by: the content hash, or the size where the file was not
 * read (`Z[i] if C[i] is None else C[i]`); a new reference. */
static PyObject *row_sameness(Tab *t, Py_ssize_t i) {
    BRow *r = c_row(t, i);
    if (r) return r->has_hash ? PyBytes_FromStringAndSize((const char *)r->digest, 16) : PyLong_FromLongLong(r->size);
    PyObject *c = PyList_GET_ITEM(t->C, i);
    return Py_NewRef(c == Py_None ? PyList_GET_ITEM(t->Z, i) : c);
}

/* Do rows a and b hold the same bytes (by the above)? 1, 0, or -1 on error. */
static int rows_alike(Tab *t, Py_ssize_t a, Py_ssize_t b) {
    BRow *x = c_row(t, a), *y = c_row(t, b);
    if (x && y) {
        if (x->has_hash != y->has_hash) return 0;
        return x->has_hash ? memcmp(x->digest, y->digest, 16) == 0 : x->size == y->size;
    }
    PyObject *u = row_sameness(t, a), *v = row_sameness(t, b);
    int eq = u && v ? PyObject_RichCompareBool(u, v, Py_EQ) : -1;
    Py_XDECREF(u);
    Py_XDECREF(v);
    return eq;
}

/* Is `item` (an item of a shape's ranks or sizes) equal to `value` of a C row, or to the
 * Python row's object? 1, 0, or -1 on error. */
static int item_equals(PyObject *item, Tab *t, Py_ssize_t i, int want_rank) {
    BRow *r = c_row(t, i);
    if (!r) return PyObject_RichCompareBool(item, PyList_GET_ITEM(want_rank ? t->K : t->Z, i), Py_EQ);
    if (!PyLong_CheckExact(item)) {
        PyObject *v = want_rank ? row_rank(t, i) : row_size(t, i);
        int eq = v ? PyObject_RichCompareBool(item, v, Py_EQ) : -1;
        Py_XDECREF(v);
        return eq;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    return !overflow && x == (want_rank ? (long long)r->rank : r->size);
}

/* Does the block of `rows` have the shape `shape` = (group, ranks, sizes, differ)? The
 * same test as the dict lookup: equal items, so equal hashes. */
static int same_shape(PyObject *shape, PyObject *group, Tab *t, const Py_ssize_t *rows, Py_ssize_t n, int differ) {
    PyObject *ranks = PyTuple_GET_ITEM(shape, 1), *sizes = PyTuple_GET_ITEM(shape, 2);
    if (PyTuple_GET_SIZE(ranks) != n || (PyTuple_GET_ITEM(shape, 3) == Py_True) != (differ != 0)) return 0;
    int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(shape, 0), group, Py_EQ);
    for (Py_ssize_t j = 0; j < n && eq > 0; j++) {
        eq = item_equals(PyTuple_GET_ITEM(ranks, j), t, rows[j], 1);
        if (eq > 0) eq = item_equals(PyTuple_GET_ITEM(sizes, j), t, rows[j], 0);
    }
    return eq;
}

/* Status, action and reason of Python row i (C rows take the verdict's value indexes). */
static void set_list_verdict(Tab *t, Py_ssize_t i, PyObject *status, PyObject *action, PyObject *reason) {
    PyList_SetItem(t->S, i, Py_NewRef(status));
    PyList_SetItem(t->A, i, Py_NewRef(action));
    PyList_SetItem(t->R, i, Py_NewRef(reason));
}

static void set_target(Tab *t, Py_ssize_t i, PyObject *tpath) {
    if (i < 0) br_set_target(t->store, -i - 1, tpath);
    else PyList_SetItem(t->T, i, Py_NewRef(tpath));
}

static PyObject *row_relpath(Tab *t, Py_ssize_t i) {
    BRow *r = c_row(t, i);
    return r ? br_relpath(t->store, r) : Py_NewRef(PyList_GET_ITEM(t->P, i));
}

/* shapes[shape] += n */
static int count_shape(PyObject *shapes, PyObject *shape, long n) {
    if (!n || shapes == Py_None) return 0;
    PyObject *count = PyDict_GetItemWithError(shapes, shape);
    if (!count && PyErr_Occurred()) return -1;
    PyObject *next = PyLong_FromLong((count ? PyLong_AsLong(count) : 0) + n);
    int rc = next ? PyDict_SetItem(shapes, shape, next) : -1;
    Py_XDECREF(next);
    return rc;
}

/* The block's shape, (group, ranks, sizes, differ): a new tuple. */
static PyObject *make_shape(Tab *t, PyObject *group, const Py_ssize_t *rows, Py_ssize_t n, int differ) {
    PyObject *ranks = PyTuple_New(n), *sizes = PyTuple_New(n), *shape = NULL;
    int ok = ranks && sizes;
    for (Py_ssize_t j = 0; j < n && ok; j++) {
        PyObject *r = row_rank(t, rows[j]), *z = row_size(t, rows[j]);
        ok = r && z;
        if (ok) {
            PyTuple_SET_ITEM(ranks, j, r);
            PyTuple_SET_ITEM(sizes, j, z);
        } else {
            Py_XDECREF(r);
            Py_XDECREF(z);
        }
    }
    if (ok) shape = PyTuple_Pack(4, group, ranks, sizes, differ ? Py_True : Py_False);
    Py_XDECREF(ranks);
    Py_XDECREF(sizes);
    return shape;
}

PyDoc_STRVAR(finish_blocks_doc,
"finish_blocks(blocks, columns, rows, order, verdicts, classify, replicas, target_prefix, targets_exist, shapes)\n"
"\n"
"Scan._finish_blocks for a bucket: per block, in (group, hash) order, extend `order` with\n"
"its rows, look its shape (group, ranks, sizes, replicas differ) up in `verdicts` (on a\n"
"miss `classify(rows, group, hex, shape)` returns the verdict and keeps it) and replay\n"
"it: status, action, reason, and the target path target_prefix +\n"
"'<hhh>/<hh>_g<group>/<hex>.bin'. The blocks are those of `blocks` ({(group, hex): [row\n"
"indexes]}) plus those the C walk filed in `rows` (a BlockRows, or None). Row indexes\n"
">= 0 are in `columns` (the 16 lists of Rows.COLUMNS), -(j + 1) is row j of `rows`.\n"
"`shapes` (None: sizes not counted) counts blocks per shape. Returns (keys of blocks a\n"
"file of which is not 'ok', now all in `blocks`: the caller finishes them one by one,\n"
"[(row, hex)] whose target path exists and is not the row).");

/* A block of the store's, as Python sees it: its key (group, hex) and row list, made
 * only for the rare block that needs them (classify, the slow path, a target to check). */
typedef struct {
    PyObject *key, *idx; /* new references, or NULL (not made yet) */
} Lazy;

static int lazy_make(Lazy *z, BlockRows *store, Py_ssize_t head) {
    if (!z->key && !(z->key = br_block_key(store, head))) return -1;
    if (!z->idx && !(z->idx = br_block_rows(store, head))) return -1;
    return 0;
}

static PyObject *finish_blocks(PyObject *self, PyObject *args) {
    PyObject *blocks, *columns, *store_obj, *order, *verdicts, *classify, *prefix, *shapes;
    int replicas, targets_exist;
    if (!PyArg_ParseTuple(args, "O!O!OO!O!OpUpO", &PyDict_Type, &blocks, &PyTuple_Type, &columns, &store_obj,
                          &PyList_Type, &order, &PyDict_Type, &verdicts, &classify, &replicas, &prefix,
                          &targets_exist, &shapes))
        return NULL;
    if (PyTuple_GET_SIZE(columns) != N_COLUMNS) {
        PyErr_SetString(PyExc_ValueError, "columns: the 16 lists of ROW_COLUMNS expected");
        return NULL;
    }
    for (int j = 0; j < N_COLUMNS; j++)
        if (!PyList_Check(PyTuple_GET_ITEM(columns, j))) {
            PyErr_SetString(PyExc_TypeError, "columns: lists expected");
            return NULL;
        }
    if (store_obj != Py_None && !PyObject_TypeCheck(store_obj, &BlockRowsType)) {
        PyErr_SetString(PyExc_TypeError, "rows: a BlockRows or None expected");
        return NULL;
    }
    Tab t = {PyTuple_GET_ITEM(columns, COL_RELPATH), PyTuple_GET_ITEM(columns, COL_RANK),
             PyTuple_GET_ITEM(columns, COL_SIZE), PyTuple_GET_ITEM(columns, COL_CONTENT),
             PyTuple_GET_ITEM(columns, COL_STATUS), PyTuple_GET_ITEM(columns, COL_ACTION),
             PyTuple_GET_ITEM(columns, COL_REASON), PyTuple_GET_ITEM(columns, COL_TARGET),
             store_obj == Py_None ? NULL : (BlockRows *)store_obj, -1};
    /* Python rows joined some blocks: every block goes through the dict */
    if (t.store && t.store->nheads && PyDict_GET_SIZE(blocks) && br_export(t.store, blocks) < 0) return NULL;
    PyObject *keys = NULL;
    Py_ssize_t nrefs = 0;
    KeyRef *refs = sorted_blocks(blocks, t.store, &nrefs, &keys);
    if (!refs) return NULL;
    PyObject *slow = PyList_New(0), *check = PyList_New(0);
    PyObject *s_ok = PyUnicode_InternFromString("ok");
    PyObject *result = NULL;
    Py_ssize_t *rows = NULL, cap = 0;
    /* Consecutive blocks mostly share a shape: the last one found in `verdicts` is reused
     * without building its tuples, and its blocks are counted into `shapes` in one go. */
    PyObject *last_shape = NULL, *last_verdict = NULL;
    long last_count = 0;
    /* The store's value indexes of a verdict's (status, action, reason), per row: worked
     * out once per verdict, not looked up for every C row. */
    PyObject *coded = NULL;
    int32_t *codes = NULL;
    Py_ssize_t codes_cap = 0;
    if (!slow || !check || !s_ok) goto out;
    if (t.store) {
        PyObject *code = PyDict_GetItemWithError(t.store->index[V_STATUS], s_ok);
        if (!code && PyErr_Occurred()) goto out;
        t.ok_code = code ? (int32_t)PyLong_AsLong(code) : -1;
    }
    for (Py_ssize_t k = 0; k < nrefs; k++) {
        KeyRef *b = &refs[k];
        Lazy z = {NULL, NULL};
        PyObject *idx = NULL, *group = NULL, *verdict = NULL, *tpath = NULL;
        int ok = 0;
        /* the block's rows */
        Py_ssize_t n = 0;
        if (b->key) {
            idx = PyDict_GetItemWithError(blocks, b->key); /* borrowed */
            if (!idx || !PyList_Check(idx)) {
                if (idx || !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "blocks: lists of row indexes expected");
                goto next;
            }
            n = PyList_GET_SIZE(idx);
        } else {
            for (Py_ssize_t j = b->head; j >= 0; j = t.store->next[j]) n++;
        }
        if (n > cap) {
            Py_ssize_t *more = PyMem_Realloc(rows, sizeof(Py_ssize_t) * (size_t)n);
            if (!more) {
                PyErr_NoMemory();
                goto next;
            }
            rows = more;
            cap = n;
        }
        if (b->key) {
            for (Py_ssize_t j = 0; j < n; j++) {
                rows[j] = PyLong_AsSsize_t(PyList_GET_ITEM(idx, j));
                if ((rows[j] == -1 && PyErr_Occurred()) || !row_in_range(&t, rows[j])) {
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "blocks: row index out of range");
                    goto next;
                }
            }
        } else {
            Py_ssize_t m = 0;
            for (Py_ssize_t j = b->head; j >= 0; j = t.store->next[j]) rows[m++] = -(j + 1);
        }
        int fine = 1;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (!row_is_ok(&t, rows[j], s_ok)) fine = 0;
            PyObject *i = idx ? Py_NewRef(PyList_GET_ITEM(idx, j)) : PyLong_FromSsize_t(rows[j]);
            int rc = i ? PyList_Append(order, i) : -1;
            Py_XDECREF(i);
            if (rc < 0) goto next;
        }
        if (!fine) { /* Python finishes it one by one, from the dict */
            if (!b->key) {
                if (lazy_make(&z, t.store, b->head) < 0 || PyDict_SetItem(blocks, z.key, z.idx) < 0) goto next;
            }
            ok = PyList_Append(slow, b->key ? b->key : z.key) == 0;
            goto next;
        }
        group = b->key ? Py_NewRef(PyTuple_GET_ITEM(b->key, 0)) : PyLong_FromLong(b->group);
        if (!group) goto next;
        int differ = 0; /* replicas differ: content hashes (or, unread, sizes) not all equal */
        for (Py_ssize_t j = 1; replicas && j < n && !differ; j++) {
            int eq = rows_alike(&t, rows[0], rows[j]);
            differ = eq < 0 ? -1 : !eq;
        }
        int same = differ < 0 ? -1 : last_shape ? same_shape(last_shape, group, &t, rows, n, differ) : 0;
        if (same > 0) {
            verdict = Py_NewRef(last_verdict);
            last_count++;
        } else if (same == 0 && count_shape(shapes, last_shape, last_count) == 0) {
            Py_CLEAR(last_shape);
            Py_CLEAR(last_verdict);
            last_count = 0;
            PyObject *shape = make_shape(&t, group, rows, n, differ);
            verdict = shape ? PyDict_GetItemWithError(verdicts, shape) : NULL; /* borrowed */
            if (verdict) { /* kept for the unit: the next blocks of this shape reuse it */
                last_verdict = Py_NewRef(verdict);
                Py_INCREF(verdict);
                last_shape = shape;
                last_count = 1;
            } else if (shape && !PyErr_Occurred() && (b->key || lazy_make(&z, t.store, b->head) == 0)) {
                PyObject *hex = PyTuple_GET_ITEM(b->key ? b->key : z.key, 1);
                verdict = PyObject_CallFunctionObjArgs(classify, idx ? idx : z.idx, group, hex, shape, NULL);
                if (verdict && count_shape(shapes, shape, 1) < 0) Py_CLEAR(verdict);
                Py_DECREF(shape);
            } else {
                Py_XDECREF(shape);
            }
        }
        if (!verdict || !PyTuple_Check(verdict) || PyTuple_GET_SIZE(verdict) != n) {
            if (verdict && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "classify: one verdict per row expected");
            goto next;
        }
        ok = 1;
        for (Py_ssize_t j = 0; j < n && ok; j++) {
            PyObject *v = PyTuple_GET_ITEM(verdict, j); /* (status, action, reason, has_target) */
            if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 4) {
                PyErr_SetString(PyExc_TypeError, "classify: (status, action, reason, has_target) expected");
                ok = 0;
                break;
            }
            if (rows[j] < 0 && coded != verdict) {
                if (n > codes_cap) {
                    int32_t *more = PyMem_Realloc(codes, sizeof(int32_t) * 3 * (size_t)n);
                    if (!more) {
                        PyErr_NoMemory();
                        ok = 0;
                        break;
                    }
                    codes = more;
                    codes_cap = n;
                }
                for (Py_ssize_t q = 0; q < n && ok; q++) {
                    PyObject *u = PyTuple_GET_ITEM(verdict, q);
                    for (int c = 0; c < N_VALUE_COLUMNS && ok; c++) {
                        codes[3 * q + c] = PyTuple_Check(u) && PyTuple_GET_SIZE(u) == 4
                                               ? br_value(t.store, c, PyTuple_GET_ITEM(u, c)) : -1;
                        ok = codes[3 * q + c] >= -1;
                    }
                }
                if (!ok) break;
                Py_XSETREF(coded, Py_NewRef(verdict));
            }
            if (rows[j] < 0) {
                BRow *r = c_row(&t, rows[j]);
                r->status = codes[3 * j];
                r->action = codes[3 * j + 1];
                r->reason = codes[3 * j + 2];
            } else {
                set_list_verdict(&t, rows[j], PyTuple_GET_ITEM(v, 0), PyTuple_GET_ITEM(v, 1), PyTuple_GET_ITEM(v, 2));
            }
            int has_target = PyObject_IsTrue(PyTuple_GET_ITEM(v, 3));
            if (has_target < 0) {
                ok = 0;
                break;
            }
            if (!has_target) continue;
            if (!tpath) { /* once per block: every replica has the same target */
                if (!b->key && PyUnicode_IS_ASCII(prefix) && b->len >= 5)
                    tpath = target_path_ascii(prefix, b->group, b->hex, b->len);
                else if (b->key || lazy_make(&z, t.store, b->head) == 0)
                    tpath = target_path(prefix, group, PyTuple_GET_ITEM(b->key ? b->key : z.key, 1));
                if (!tpath) {
                    ok = 0;
                    break;
                }
            }
            set_target(&t, rows[j], tpath);
            if (targets_exist) {
                PyObject *relpath = row_relpath(&t, rows[j]);
                int same_path = relpath ? PyUnicode_Compare(tpath, relpath) : -1;
                Py_XDECREF(relpath);
                if (same_path == -1 && PyErr_Occurred()) {
                    ok = 0;
                    break;
                }
                if (same_path != 0) {
                    PyObject *i = PyLong_FromSsize_t(rows[j]);
                    PyObject *pair = i && (b->key || lazy_make(&z, t.store, b->head) == 0)
                                         ? PyTuple_Pack(2, i, PyTuple_GET_ITEM(b->key ? b->key : z.key, 1)) : NULL;
                    ok = pair && PyList_Append(check, pair) == 0;
                    Py_XDECREF(i);
                    Py_XDECREF(pair);
                }
            }
        }
    next:
        Py_XDECREF(tpath);
        Py_XDECREF(verdict);
        Py_XDECREF(group);
        Py_XDECREF(z.key);
        Py_XDECREF(z.idx);
        if (!ok) goto out;
    }
    if (count_shape(shapes, last_shape, last_count) < 0) goto out;
    result = PyTuple_Pack(2, slow, check);
out:
    if (t.store) br_blocks_clear(t.store); /* finished (or failed): the next bucket starts afresh */
    Py_XDECREF(coded);
    PyMem_Free(codes);
    PyMem_Free(rows);
    PyMem_Free(refs);
    Py_XDECREF(keys);
    Py_XDECREF(last_shape);
    Py_XDECREF(last_verdict);
    Py_XDECREF(slow);
    Py_XDECREF(check);
    Py_XDECREF(s_ok);
    return result;
}

PyDoc_STRVAR(pdeath_doc,
"die_with_parent(signum): prctl(PR_SET_PDEATHSIG, signum) for this process (a scan worker;\n"
"without ctypes, whose import costs a worker ~5 ms before its first task). OSError on failure.");

static PyObject *die_with_parent(PyObject *self, PyObject *arg) {
    long sig = PyLong_AsLong(arg);
    if (sig == -1 && PyErr_Occurred()) return NULL;
    if (prctl(PR_SET_PDEATHSIG, (unsigned long)sig, 0, 0, 0) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hash_doc, "xxh3_128_digest(data) -> bytes: the vendored XXH3-128 (tests compare it with xxhash).");

static PyObject *xxh3_128_digest(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    XXH128_hash_t h = XXH3_128bits(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    return PyBytes_FromStringAndSize((const char *)c.digest, 16);
}

/* --- CRC-32C (Castagnoli), the checksum vLLM's fs tier may keep in an xattr -------------- */

static uint32_t crc32c_table[8][256];
static int crc32c_ready = 0;

static void crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc32c_table[t][n] = (crc32c_table[t - 1][n] >> 8) ^ crc32c_table[0][crc32c_table[t - 1][n] & 0xff];
    crc32c_ready = 1;
}

/* slicing-by-8 over `len` bytes, continuing from the (non-inverted) running value `crc` */
static uint32_t crc32c_update(uint32_t crc, const unsigned char *p, size_t len) {
    crc = ~crc;
    while (len && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ crc32c_table[0][(crc ^ *p++) & 0xff]; len--; }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (len >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;  /* little-endian loads (x86, aarch64) */
        crc = crc32c_table[7][lo & 0xff] ^ crc32c_table[6][(lo >> 8) & 0xff] ^ crc32c_table[5][(lo >> 16) & 0xff]
            ^ crc32c_table[4][lo >> 24] ^ crc32c_table[3][hi & 0xff] ^ crc32c_table[2][(hi >> 8) & 0xff]
            ^ crc32c_table[1][(hi >> 16) & 0xff] ^ crc32c_table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
#endif
    while (len--) crc = (crc >> 8) ^ crc32c_table[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

PyDoc_STRVAR(crc32c_doc, "crc32c(data, crc=0) -> int: CRC-32C of data, continuing from crc (as zlib.crc32).");

static PyObject *crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long crc = 0;
    if (!PyArg_ParseTuple(args, "y*|k", &view, &crc)) return NULL;
    if (!crc32c_ready) crc32c_init();
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS
    out = crc32c_update((uint32_t)crc, (const unsigned char *)view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(out);
}

/* --- one flat directory (scan/flat.py) ------------------------------------------------ */

PyDoc_STRVAR(stat_flat_doc,
"stat_flat(dir_path, names, hashed) -> (codes, stats, digests, heads)\n"
"\n"
"lstat (hashed: open, fstat, read whole and XXH3-128) every name of `names` (a tuple of\n"
"str) in one folder, by file descriptor, with the GIL released: a flat family's page files\n"
"(scan/flat.py), where a million names share one folder. `codes[i]` is 0 when file i is\n"
"plain (a regular file; hashed: non-empty, not sparse, not zero-filled, unchanged while\n"
"read), else 1: the caller reads it in Python, which words what it is. `stats` holds six\n"
"int64 columns of len(names) each: size, mtime_ns, inode, dev, nlink, ctime_ns; hashed: `digests` 16 bytes and\n"
"`heads` 4 bytes (the first bytes, fewer when the file is shorter) per name, else None.\n"
"A name that is not ASCII is left to the caller (code 1).");

static PyObject *stat_flat(PyObject *self, PyObject *args) {
    PyObject *dpath_obj, *names;
    int hashed;
    if (!PyArg_ParseTuple(args, "O&O!p", PyUnicode_FSConverter, &dpath_obj, &PyTuple_Type, &names, &hashed))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    PyObject *codes = NULL, *stats = NULL, *digests = NULL, *heads = NULL, *result = NULL;
    const char **cnames = NULL;
    unsigned char *buf = NULL;
    int dfd = -1;
    codes = PyBytes_FromStringAndSize(NULL, n);
    stats = PyBytes_FromStringAndSize(NULL, n * 6 * (Py_ssize_t)sizeof(int64_t));
    if (hashed) {
        digests = PyBytes_FromStringAndSize(NULL, n * 16);
        heads = PyBytes_FromStringAndSize(NULL, n * HEAD_BYTES);
    }
    cnames = malloc(sizeof(char *) * (size_t)(n ? n : 1));
    if (hashed) buf = malloc(STREAM_CHUNK + 64);
    if (!codes || !stats || (hashed && (!digests || !heads))) goto out;
    if (!cnames || (hashed && !buf)) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyTuple_GET_ITEM(names, i);
        cnames[i] = PyUnicode_Check(s) && PyUnicode_IS_ASCII(s) ? (const char *)PyUnicode_DATA(s) : NULL;
    }
    char *code = PyBytes_AS_STRING(codes);
    int64_t *st_out = (int64_t *)PyBytes_AS_STRING(stats);
    unsigned char *dg = hashed ? (unsigned char *)PyBytes_AS_STRING(digests) : NULL;
    unsigned char *hd = hashed ? (unsigned char *)PyBytes_AS_STRING(heads) : NULL;
    const char *dpath = PyBytes_AS_STRING(dpath_obj);
    int open_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    dfd = open(dpath, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) open_errno = errno;
    for (Py_ssize_t i = 0; dfd >= 0 && i < n; i++) {
        Record rec;
        int v = UNUSUAL;
        for (int k = 0; k < 6; k++) st_out[k * n + i] = 0;
        if (cnames[i]) {
            if (hashed) {
                v = hash_block(dfd, cnames[i], buf, STREAM_CHUNK + 1, &rec, hd + HEAD_BYTES * i);
            } else {
                struct stat st;
                v = fstatat(dfd, cnames[i], &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
                    fill_stat(&rec, &st) ? TAKEN : UNUSUAL;
            }
        }
        code[i] = v == TAKEN ? 0 : 1; /* (vanished too: the caller's lstat says so, as it always has) */
        if (v != TAKEN) continue;
        st_out[i] = rec.size;
        st_out[n + i] = rec.mtime_ns;
        st_out[2 * n + i] = (int64_t)rec.ino;
        st_out[3 * n + i] = (int64_t)rec.dev;
        st_out[4 * n + i] = (int64_t)rec.nlink;
        st_out[5 * n + i] = rec.ctime_ns; /* (a --baseline trusts a row only if it is unchanged) */
        if (hashed) memcpy(dg + 16 * i, rec.digest, 16);
    }
    if (dfd >= 0) close(dfd);
    Py_END_ALLOW_THREADS
    if (dfd < 0) {
        errno = open_errno;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, dpath_obj);
        goto out;
    }
    result = PyTuple_Pack(4, codes, stats, digests ? digests : Py_None, heads ? heads : Py_None);
out:
    Py_XDECREF(codes);
    Py_XDECREF(stats);
    Py_XDECREF(digests);
    Py_XDECREF(heads);
    Py_DECREF(dpath_obj);
    free(cnames);
    free(buf);
    return result;
}

static PyMethodDef methods[] = {
    {"walk_bucket", walk_bucket, METH_VARARGS, walk_bucket_doc},
    {"finish_blocks", finish_blocks, METH_VARARGS, finish_blocks_doc},
    {"die_with_parent", die_with_parent, METH_O, pdeath_doc},
    {"xxh3_128_digest", xxh3_128_digest, METH_O, hash_doc},
    {"crc32c", crc32c, METH_VARARGS, crc32c_doc},
    {"stat_flat", stat_flat, METH_VARARGS, stat_flat_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvmigrate._leafwalk",
    "The healthy-block leaf loop of scan, in C (optional; kvmigrate.scan falls back to Python).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__leafwalk(void) {
    if (PyType_Ready(&BlockRowsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAM_CHUNK", (long)STREAM_CHUNK) < 0) Py_CLEAR(m);
    if (m && PyModule_AddObjectRef(m, "BlockRows", (PyObject *)&BlockRowsType) < 0) Py_CLEAR(m);
    PyObject *names = m ? PyTuple_New(N_COLUMNS) : NULL;
    for (int j = 0; names && j < N_COLUMNS; j++) {
        PyObject *name = PyUnicode_FromString(ROW_COLUMNS[j]);
        if (!name) Py_CLEAR(names);
        else PyTuple_SET_ITEM(names, j, name);
    }
    if (m && (!names || PyModule_AddObject(m, "ROW_COLUMNS", names) < 0)) {
        Py_XDECREF(names);
        Py_CLEAR(m);
    }
    return m;
}
