/* SHA-256 and HMAC-SHA256 for the connection handshake (see auth.h). */
#define _GNU_SOURCE
#include "auth.h"
#include "util.h" /* RS_RETRY_EINTR: a macro, so auth.c still builds on its own */

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static uint32_t load_be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void store_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* One 64-byte block into the state (FIPS 180-4, section 6.2.2). */
static void compress(uint32_t h[8], const unsigned char *block) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = load_be32(block + 4 * t);
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                      K[t] + w[t];
        uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d;
    h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

void rs_sha256_init(rs_sha256_t *s) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof iv);
    s->total = 0;
    s->fill = 0;
}

void rs_sha256_update(rs_sha256_t *s, const void *data, size_t len) {
    const unsigned char *p = data;
    s->total += len;
    while (len > 0) {
        size_t take = RS_SHA256_BLOCK - s->fill;
        if (take > len)
            take = len;
        memcpy(s->block + s->fill, p, take);
        s->fill += take;
        p += take;
        len -= take;
        if (s->fill == RS_SHA256_BLOCK) {
            compress(s->h, s->block);
            s->fill = 0;
        }
    }
}

void rs_sha256_final(rs_sha256_t *s, unsigned char out[RS_SHA256_BYTES]) {
    /* Padding: a 1 bit, zeros up to 56 mod 64, then the length in bits (big-endian). */
    uint64_t bits = s->total * 8;
    unsigned char pad[RS_SHA256_BLOCK + 8] = {0x80};
    size_t zeros = (s->fill < 56 ? 56 : 120) - s->fill;
    for (int i = 0; i < 8; i++)
        pad[zeros + i] = (unsigned char)(bits >> (56 - 8 * i));
    rs_sha256_update(s, pad, zeros + 8);
    for (int i = 0; i < 8; i++)
        store_be32(out + 4 * i, s->h[i]);
}

void rs_hmac_init(rs_hmac_t *m, const void *key, size_t key_len) {
    /* Keys longer than a block are hashed first; shorter ones are padded with zeros. */
    unsigned char k[RS_SHA256_BLOCK] = {0};
    if (key_len > RS_SHA256_BLOCK) {
        rs_sha256_t s;
        rs_sha256_init(&s);
        rs_sha256_update(&s, key, key_len);
        rs_sha256_final(&s, k);
    } else if (key_len > 0) {
        memcpy(k, key, key_len);
    }
    unsigned char inner_key[RS_SHA256_BLOCK];
    for (int i = 0; i < RS_SHA256_BLOCK; i++) {
        inner_key[i] = k[i] ^ 0x36;
        m->outer_key[i] = k[i] ^ 0x5c;
    }
    rs_sha256_init(&m->inner);
    rs_sha256_update(&m->inner, inner_key, sizeof inner_key);
}

void rs_hmac_update(rs_hmac_t *m, const void *data, size_t len) {
    rs_sha256_update(&m->inner, data, len);
}

void rs_hmac_final(rs_hmac_t *m, unsigned char out[RS_SHA256_BYTES]) {
    unsigned char inner[RS_SHA256_BYTES];
    rs_sha256_final(&m->inner, inner);
    rs_sha256_t outer;
    rs_sha256_init(&outer);
    rs_sha256_update(&outer, m->outer_key, sizeof m->outer_key);
    rs_sha256_update(&outer, inner, sizeof inner);
    rs_sha256_final(&outer, out);
}

int rs_equal_secret(const void *a, const void *b, size_t len) {
    const volatile unsigned char *x = a, *y = b;
    unsigned char diff = 0;
    for (size_t i = 0; i < len; i++)
        diff |= x[i] ^ y[i];
    return diff == 0;
}

/* /dev/urandom, for kernels older than getrandom() (Linux 3.17). */
static int urandom_bytes(unsigned char *p, size_t len) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    while (len > 0) {
        ssize_t r;
        RS_RETRY_EINTR(r, read(fd, p, len));
        if (r <= 0) {
            close(fd);
            return -1;
        }
        p += r;
        len -= (size_t)r;
    }
    close(fd);
    return 0;
}

int rs_random_bytes(void *buf, size_t len) {
    unsigned char *p = buf;
    while (len > 0) {
        ssize_t r;
        RS_RETRY_EINTR(r, getrandom(p, len, 0));
        if (r < 0)
            return errno == ENOSYS ? urandom_bytes(p, len) : -1;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}
