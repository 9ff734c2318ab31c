/* SPDX-License-Identifier: Apache-2.0 */
/* The weight-file format (documented in pd/model/model.h): writing it, and a parser that checks
 * every field of a possibly hostile file before trusting it - sizes against the file length with
 * checked arithmetic, the table against the canonical one, both checksums - and says what is wrong.
 */
#include "common/crc32c.h"
#include "pd/model/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/checked.h"

#define INVAL KVB_ERR_INVALID_ARG

/* The payload is the in-memory float array, written and read as is. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "weight files are little-endian");

static const char magic[8] = {'K', 'V', 'B', 'M', 'O', 'D', 'E', 'L'};

enum {
    OFF_VERSION = 8,
    OFF_HEADER_BYTES = 12,
    OFF_ATTN = 16,
    OFF_DIMS = 20, /* 11 u32 */
    OFF_THETA = 64,
    OFF_EPS = 68,
    OFF_NAME = 72,
    NAME_BYTES = 32,
    OFF_N_TENSORS = 104,
    OFF_PAYLOAD_CRC = 108,
    OFF_PAYLOAD_BYTES = 112,
    OFF_RESERVED = 120,
    OFF_HEADER_CRC = 124,
    ENTRY_NAME = 40,
};

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put64(unsigned char *p, uint64_t v)
{
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

static uint32_t get32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const unsigned char *p)
{
    return get32(p) | (uint64_t)get32(p + 4) << 32;
}

static uint32_t *dim_fields(kvb_pd_config_t *c, size_t i)
{
    uint32_t *f[11] = {&c->n_layers, &c->hidden,     &c->ffn,       &c->vocab,
                       &c->n_heads,  &c->n_kv_heads, &c->head_dim,  &c->kv_lora_rank,
                       &c->nope_dim, &c->rope_dim,   &c->v_head_dim};
    return f[i];
}

static uint32_t header_crc(const unsigned char *h, size_t header_bytes)
{
    static const unsigned char zero[4];
    uint32_t crc = kvb__crc32c(0, h, OFF_HEADER_CRC);
    crc = kvb__crc32c(crc, zero, 4);
    return kvb__crc32c(crc, h + OFF_HEADER_CRC + 4, header_bytes - OFF_HEADER_CRC - 4);
}

/* The header and tensor table of `m`, malloc'd, header_bytes long. */
static unsigned char *encode_header(const kvb_pd_model_t *m, size_t *header_bytes)
{
    size_t hb = KVB__MODEL_FILE_HEADER + KVB__MODEL_FILE_ENTRY * m->num_tensors;
    unsigned char *h = calloc(1, hb);
    if (!h)
        return NULL;
    kvb_pd_config_t c = m->cfg;
    memcpy(h, magic, sizeof magic);
    put32(h + OFF_VERSION, KVB__MODEL_FILE_VERSION);
    put32(h + OFF_HEADER_BYTES, (uint32_t)hb);
    put32(h + OFF_ATTN, (uint32_t)c.attn);
    for (size_t i = 0; i < 11; i++)
        put32(h + OFF_DIMS + 4 * i, *dim_fields(&c, i));
    memcpy(h + OFF_THETA, &c.rope_theta, 4);
    memcpy(h + OFF_EPS, &c.norm_eps, 4);
    memcpy(h + OFF_NAME, m->name, strlen(m->name));
    put32(h + OFF_N_TENSORS, (uint32_t)m->num_tensors);
    put32(h + OFF_PAYLOAD_CRC, m->payload_crc);
    put64(h + OFF_PAYLOAD_BYTES, m->payload_bytes);
    for (size_t i = 0; i < m->num_tensors; i++) {
        const kvb__model_tensor_t *t = &m->tensors[i];
        unsigned char *e = h + KVB__MODEL_FILE_HEADER + KVB__MODEL_FILE_ENTRY * i;
        memcpy(e, t->name, strlen(t->name));
        put32(e + ENTRY_NAME, t->rows);
        put32(e + ENTRY_NAME + 4, t->cols);
        put64(e + ENTRY_NAME + 8, t->offset * sizeof(float));
        put64(e + ENTRY_NAME + 16, (uint64_t)t->rows * t->cols * sizeof(float));
    }
    put32(h + OFF_HEADER_CRC, header_crc(h, hb));
    *header_bytes = hb;
    return h;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    while (len) {
        ssize_t k = write(fd, p, len > (1u << 30) ? (1u << 30) : len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

int kvb_pd_model_save(const kvb_pd_model_t *m, const char *path, char *r, size_t cap)
{
    size_t hb = 0;
    char tmp[4096];
    if (!m || !path || !*path)
        return kvb__fail(r, cap, INVAL, "model or path missing");
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= sizeof tmp)
        return kvb__fail(r, cap, INVAL, "path is too long");
    unsigned char *h = encode_header(m, &hb);
    if (!h)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0 &&
        (write_all(fd, h, hb) || write_all(fd, m->data, (size_t)m->payload_bytes) || fsync(fd)))
        err = errno ? errno : EIO;
    if (fd >= 0 && close(fd) && !err)
        err = errno;
    if (!err && rename(tmp, path))
        err = errno;
    free(h);
    if (err) {
        if (fd >= 0)
            unlink(tmp);
        return kvb__fail(r, cap, KVB_ERR_SYSTEM, "cannot write %s: %s", path, strerror(err));
    }
    kvb__reason_clear(r, cap);
    return KVB_OK;
}

/* ---- Parsing ------------------------------------------------------------------------------- */

/* Magic, version and the header's own size and checksum. */
static int parse_frame(const unsigned char *b, size_t len, size_t *hb_out, char *r, size_t cap)
{
    if (len < KVB__MODEL_FILE_HEADER)
        return kvb__fail(r, cap, INVAL,
                         "file is truncated: %zu bytes, the fixed header alone is %u", len,
                         KVB__MODEL_FILE_HEADER);
    if (memcmp(b, magic, sizeof magic))
        return kvb__fail(r, cap, INVAL, "bad magic: not a kvbridge model file");
    uint32_t version = get32(b + OFF_VERSION);
    if (version != KVB__MODEL_FILE_VERSION)
        return kvb__fail(r, cap, KVB_ERR_UNSUPPORTED,
                         "unsupported file version %u (this build reads version %u)", version,
                         KVB__MODEL_FILE_VERSION);
    uint32_t n = get32(b + OFF_N_TENSORS), hb = get32(b + OFF_HEADER_BYTES);
    uint32_t n_max = 3 + 11 * KVB_PD_LAYERS_MAX;
    if (n == 0 || n > n_max)
        return kvb__fail(r, cap, INVAL, "tensor count %u is out of range [1, %u]", n, n_max);
    if (hb != KVB__MODEL_FILE_HEADER + KVB__MODEL_FILE_ENTRY * n)
        return kvb__fail(r, cap, INVAL, "header_bytes %u, expected %u for %u tensors", hb,
                         KVB__MODEL_FILE_HEADER + KVB__MODEL_FILE_ENTRY * n, n);
    if (len < hb)
        return kvb__fail(r, cap, INVAL,
                         "file is truncated: %zu bytes, the header and tensor table take %u", len,
                         hb);
    uint32_t want = get32(b + OFF_HEADER_CRC), got = header_crc(b, hb);
    if (want != got)
        return kvb__fail(r, cap, INVAL,
                         "header checksum mismatch: stored %08x, computed %08x (corrupt file)",
                         want, got);
    if (get32(b + OFF_RESERVED))
        return kvb__fail(r, cap, INVAL, "reserved header field is not 0");
    *hb_out = hb;
    return KVB_OK;
}

/* The config and name fields. */
static int parse_config(const unsigned char *b, kvb_pd_config_t *c, char *name, char *r, size_t cap)
{
    int rc;
    memset(c, 0, sizeof *c);
    c->attn = (kvb_kv_attn_t)get32(b + OFF_ATTN);
    for (size_t i = 0; i < 11; i++)
        *dim_fields(c, i) = get32(b + OFF_DIMS + 4 * i);
    memcpy(&c->rope_theta, b + OFF_THETA, 4);
    memcpy(&c->norm_eps, b + OFF_EPS, 4);
    if ((rc = kvb__model_config_check(c, r, cap)))
        return rc;
    const char *nm = (const char *)b + OFF_NAME;
    size_t nlen = strnlen(nm, NAME_BYTES);
    for (size_t i = nlen; i < NAME_BYTES; i++)
        if (nm[i])
            return kvb__fail(r, cap, INVAL, "model name is not NUL-terminated and padded");
    if ((rc = kvb__model_name_check(nm, nlen, r, cap)))
        return rc;
    memcpy(name, nm, nlen);
    name[nlen] = '\0';
    return KVB_OK;
}

/* One table entry against the canonical tensor t. */
static int parse_entry(const unsigned char *e, uint32_t i, const kvb__model_tensor_t *t, char *r,
                       size_t cap)
{
    char name[ENTRY_NAME + 1];
    uint64_t bytes, off = get64(e + ENTRY_NAME + 8), nbytes = get64(e + ENTRY_NAME + 16);
    uint32_t rows = get32(e + ENTRY_NAME), cols = get32(e + ENTRY_NAME + 4);
    memcpy(name, e, ENTRY_NAME);
    name[ENTRY_NAME] = '\0';
    for (size_t k = strlen(name); k < ENTRY_NAME; k++)
        if (e[k])
            return kvb__fail(r, cap, INVAL, "tensor %u: name is not NUL-padded", i);
    if (strcmp(name, t->name))
        return kvb__fail(r, cap, INVAL, "tensor %u is '%.40s', expected '%s'", i, name, t->name);
    if (kvb__mul_u64(rows, cols, &bytes) || kvb__mul_u64(bytes, sizeof(float), &bytes))
        return kvb__fail(r, cap, KVB_ERR_OVERFLOW, "tensor '%s': shape %ux%u overflows", t->name,
                         rows, cols);
    if (rows != t->rows || cols != t->cols)
        return kvb__fail(r, cap, INVAL, "tensor '%s': shape %ux%u, the config needs %ux%u", t->name,
                         rows, cols, t->rows, t->cols);
    if (nbytes != bytes || off != t->offset * sizeof(float))
        return kvb__fail(
            r, cap, INVAL, "tensor '%s': offset %llu and size %llu, expected %llu and %llu",
            t->name, (unsigned long long)off, (unsigned long long)nbytes,
            (unsigned long long)(t->offset * sizeof(float)), (unsigned long long)bytes);
    return KVB_OK;
}

/* The table, the payload's size against the file's, and the payload checksum. */
static int parse_body(const unsigned char *b, size_t len, size_t hb, const kvb__model_tensor_t *t,
                      size_t num_tensors, uint64_t payload_bytes, char *r, size_t cap)
{
    int rc;
    uint32_t n = get32(b + OFF_N_TENSORS);
    if (n != num_tensors)
        return kvb__fail(r, cap, INVAL, "file has %u tensors, the config needs %zu", n,
                         num_tensors);
    for (uint32_t i = 0; i < n; i++)
        if ((rc = parse_entry(b + KVB__MODEL_FILE_HEADER + (size_t)KVB__MODEL_FILE_ENTRY * i, i,
                              &t[i], r, cap)))
            return rc;
    uint64_t pb = get64(b + OFF_PAYLOAD_BYTES), total;
    if (pb != payload_bytes)
        return kvb__fail(r, cap, INVAL, "payload_bytes %llu, the tensors need %llu",
                         (unsigned long long)pb, (unsigned long long)payload_bytes);
    if (kvb__add_u64(hb, pb, &total) || len < total)
        return kvb__fail(r, cap, INVAL,
                         "file is truncated: %zu bytes, header and payload need %llu", len,
                         (unsigned long long)total);
    if (len > total)
        return kvb__fail(r, cap, INVAL, "%llu unexpected bytes after the payload",
                         (unsigned long long)(len - total));
    uint32_t want = get32(b + OFF_PAYLOAD_CRC), got = kvb__crc32c(0, b + hb, (size_t)pb);
    if (want != got)
        return kvb__fail(r, cap, INVAL,
                         "payload checksum mismatch: stored %08x, computed %08x (corrupt file)",
                         want, got);
    return KVB_OK;
}

/* Non-finite weights would turn every logit into NaN; refuse them with the tensor's name. */
static int check_finite(const kvb_pd_model_t *m, char *r, size_t cap)
{
    for (size_t k = 0; k < m->num_tensors; k++) {
        const kvb__model_tensor_t *t = &m->tensors[k];
        const float *w = m->data + t->offset;
        size_t n = (size_t)t->rows * t->cols;
        for (size_t i = 0; i < n; i++)
            if (!isfinite(w[i]))
                return kvb__fail(r, cap, INVAL, "tensor '%s': value %zu is not finite", t->name, i);
    }
    return KVB_OK;
}

int kvb_pd_model_parse(const void *buf, size_t len, kvb_pd_model_t **out, char *r, size_t cap)
{
    const unsigned char *b = buf;
    kvb_pd_config_t cfg;
    char name[KVB_PD_NAME_MAX + 1];
    kvb_pd_model_t *m;
    size_t hb = 0;
    int rc;
    if (!out || (!buf && len))
        return kvb__fail(r, cap, INVAL, "buffer or out is NULL");
    if ((rc = parse_frame(b, len, &hb, r, cap)) || (rc = parse_config(b, &cfg, name, r, cap)))
        return rc;
    /* Every size is checked against the file before anything as large as the payload is
     * allocated, so a short hostile file cannot make us reserve gigabytes. */
    kvb__model_tensor_t *t;
    size_t nt;
    uint64_t floats;
    if (kvb__model_tensor_table(&cfg, &t, &nt, &floats))
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory");
    rc = parse_body(b, len, hb, t, nt, floats * sizeof(float), r, cap);
    free(t);
    if (rc || (rc = kvb__model_alloc(&cfg, name, &m, r, cap)))
        return rc;
    memcpy(m->data, b + hb, (size_t)m->payload_bytes);
    if ((rc = check_finite(m, r, cap)))
        goto fail;
    kvb__model_seal(m);
    kvb__reason_clear(r, cap);
    *out = m;
    return KVB_OK;
fail:
    kvb_pd_model_free(m);
    return rc;
}

/* Reads all of fd (a regular file of `size` bytes) into a malloc'd buffer. */
static int read_file(int fd, size_t size, unsigned char **out, char *r, size_t cap)
{
    unsigned char *buf = malloc(size ? size : 1);
    size_t n = 0;
    if (!buf)
        return kvb__fail(r, cap, KVB_ERR_NOMEM, "out of memory for %zu bytes", size);
    while (n < size) {
        ssize_t k = read(fd, buf + n, size - n > (1u << 30) ? (1u << 30) : size - n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            int err = k < 0 ? errno : 0;
            free(buf);
            if (err)
                return kvb__fail(r, cap, KVB_ERR_SYSTEM, "read failed: %s", strerror(err));
            return kvb__fail(r, cap, INVAL, "file shrank while it was read");
        }
        n += (size_t)k;
    }
    *out = buf;
    return KVB_OK;
}

int kvb_pd_model_load(const char *path, kvb_pd_model_t **out, char *r, size_t cap)
{
    const uint64_t max =
        KVB__MODEL_FILE_HEADER + KVB__MODEL_FILE_ENTRY * 4096ull + KVB_PD_WEIGHTS_MAX;
    struct stat st;
    unsigned char *buf = NULL;
    int rc;
    if (!path || !*path || !out)
        return kvb__fail(r, cap, INVAL, "path or out missing");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvb__fail(r, cap, KVB_ERR_SYSTEM, "cannot open %s: %s", path, strerror(errno));
    if (fstat(fd, &st))
        rc = kvb__fail(r, cap, KVB_ERR_SYSTEM, "cannot stat %s: %s", path, strerror(errno));
    else if (!S_ISREG(st.st_mode))
        rc = kvb__fail(r, cap, INVAL, "%s is not a regular file", path);
    else if ((uint64_t)st.st_size > max)
        rc = kvb__fail(r, cap, KVB_ERR_TOO_LARGE, "%s: %lld bytes is larger than any model", path,
                       (long long)st.st_size);
    else
        rc = read_file(fd, (size_t)st.st_size, &buf, r, cap);
    close(fd);
    if (rc)
        return rc;
    rc = kvb_pd_model_parse(buf, (size_t)st.st_size, out, r, cap);
    free(buf);
    if (rc && r && cap) {
        char why[KVB_PD_REASON_MAX];
        snprintf(why, sizeof why, "%s", r);
        snprintf(r, cap, "%s: %s", path, why);
    }
    return rc;
}
