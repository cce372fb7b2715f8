/* SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for the connection handshake: small
 * enough to read in one sitting, so the core needs no crypto library. auth.c calls nothing
 * of the core (util.h lends it a macro only): the unit test compiles it on its own. */
#ifndef RINGSYNC_AUTH_H
#define RINGSYNC_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define RS_SHA256_BYTES 32
#define RS_SHA256_BLOCK 64

typedef struct {
    uint32_t h[8];
    uint64_t total; /* bytes hashed so far */
    unsigned char block[RS_SHA256_BLOCK];
    size_t fill; /* bytes waiting in block */
} rs_sha256_t;

void rs_sha256_init(rs_sha256_t *s);
void rs_sha256_update(rs_sha256_t *s, const void *data, size_t len);
void rs_sha256_final(rs_sha256_t *s, unsigned char out[RS_SHA256_BYTES]);

/* HMAC over data given piece by piece: init, update as often as needed, final. */
typedef struct {
    rs_sha256_t inner;
    unsigned char outer_key[RS_SHA256_BLOCK]; /* key ^ opad, kept for final */
} rs_hmac_t;

void rs_hmac_init(rs_hmac_t *m, const void *key, size_t key_len);
void rs_hmac_update(rs_hmac_t *m, const void *data, size_t len);
void rs_hmac_final(rs_hmac_t *m, unsigned char out[RS_SHA256_BYTES]);

/* Whether a and b are equal, in time that depends only on len (a MAC check must not tell
 * an attacker how many leading bytes were right). */
int rs_equal_secret(const void *a, const void *b, size_t len);

/* Fill buf with bytes from the kernel's random source; -1 (errno set) on failure. */
int rs_random_bytes(void *buf, size_t len);

#endif
