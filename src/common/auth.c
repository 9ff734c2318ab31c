/* SPDX-License-Identifier: Apache-2.0 */
/* Peer authentication primitives: HMAC-SHA256 and randomness from libcrypto (no hand-written
 * cryptography), a constant-time compare, and loading the cluster secret from a file. */
#include "common/auth.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "kvbridge/status.h"

/* The HMAC implementation, fetched once: EVP_MAC_fetch searches the provider tables under a lock
 * each time (most of the cost of one small HMAC), while a fetched EVP_MAC may be shared by
 * threads, each with a context of its own. Kept for the life of the process. */
static pthread_once_t hmac_once = PTHREAD_ONCE_INIT;
static EVP_MAC *hmac_alg;

static void hmac_fetch(void)
{
    hmac_alg = EVP_MAC_fetch(NULL, "HMAC", NULL);
}

int kvb__hmac(const void *key, size_t key_len, const kvb_mac_part_t *parts, size_t nparts,
              uint8_t out[KVB_MAC_LEN])
{
    /* HMAC_CTX is deprecated in OpenSSL 3; EVP_MAC is the supported interface. */
    static const unsigned char empty[1];
    pthread_once(&hmac_once, hmac_fetch);
    EVP_MAC_CTX *ctx = hmac_alg ? EVP_MAC_CTX_new(hmac_alg) : NULL;
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", "SHA256", 0),
                           OSSL_PARAM_construct_end()};
    size_t outl = 0;
    int ok = ctx && EVP_MAC_init(ctx, key_len ? key : empty, key_len, params);
    for (size_t i = 0; ok && i < nparts; i++)
        ok = EVP_MAC_update(ctx, parts[i].p, parts[i].len);
    ok = ok && EVP_MAC_final(ctx, out, &outl, KVB_MAC_LEN) && outl == KVB_MAC_LEN;
    EVP_MAC_CTX_free(ctx);
    if (!ok) {
        KVB_ERROR("HMAC-SHA256 failed in libcrypto");
        return KVB_ERR_SYSTEM;
    }
    return KVB_OK;
}

int kvb__random(void *buf, size_t len)
{
    if (len > (size_t)INT32_MAX || RAND_bytes(buf, (int)len) != 1) {
        KVB_ERROR("no random bytes from libcrypto");
        return KVB_ERR_SYSTEM;
    }
    return KVB_OK;
}

bool kvb__ct_equal(const void *a, const void *b, size_t n)
{
    return CRYPTO_memcmp(a, b, n) == 0;
}

void kvb__wipe(void *p, size_t n)
{
    if (p && n)
        OPENSSL_cleanse(p, n);
}

int kvb__secret_load(const char *path, uint8_t **out, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        KVB_ERROR("secret file %s: %s", path, strerror(errno));
        return KVB_ERR_NOT_FOUND;
    }
    struct stat st;
    uint8_t *buf = malloc(KVB_SECRET_MAX + 2);
    size_t n = 0;
    int rc = buf && fstat(fd, &st) == 0 ? KVB_OK : KVB_ERR_SYSTEM;
    while (rc == KVB_OK && n < KVB_SECRET_MAX + 2) {
        ssize_t r = read(fd, buf + n, KVB_SECRET_MAX + 2 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            rc = KVB_ERR_SYSTEM;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    if (rc == KVB_OK && n > 0 && buf[n - 1] == '\n')
        n--;
    if (rc == KVB_OK && (n < KVB_SECRET_MIN || n > KVB_SECRET_MAX)) {
        KVB_ERROR("secret file %s: the secret must be %d to %d bytes", path, KVB_SECRET_MIN,
                  KVB_SECRET_MAX);
        rc = KVB_ERR_INVALID_ARG;
    }
    if (rc) {
        kvb__secret_free(buf, KVB_SECRET_MAX + 2);
        return rc;
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO))
        KVB_WARN("secret file %s can be read by other users (chmod 600 it)", path);
    *out = buf;
    *len = n;
    return KVB_OK;
}

void kvb__secret_free(uint8_t *secret, size_t len)
{
    kvb__wipe(secret, len);
    free(secret);
}
