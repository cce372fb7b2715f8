/* Negotiation: ranks submit tensors in any order; a tensor runs once every rank has
 * submitted it, and every rank derives the same ready list in the same order from the
 * same gathered messages (no coordinator). A tensor negotiated once is cached: later
 * submissions with the same metadata cost one bit in a fixed-size bitset. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "negotiate.h"

/* ---- negotiator state ---- */

/* Out of memory on this rank's side of a round: the words go into the communicator's
 * record here; rs_negotiate then breaks the communicator (the peers are mid-round). */
static rs_status_t no_memory(const rs_negotiator_t *n, const char *what) {
    return rs_fail(n->comm, RS_ERR_NOMEM, "rank %d: out of memory while negotiating (%s)",
                   n->rank, what);
}

rs_status_t rs_negotiator_init(rs_negotiator_t *n, rs_comm_t *comm, int capacity) {
    memset(n, 0, sizeof *n);
    n->comm = comm;
    n->rank = comm->rank;
    n->size = comm->size;
    n->capacity = capacity > 0 ? capacity : 0;
    n->cache_names = calloc((size_t)n->capacity + 1, sizeof *n->cache_names);
    n->cache_metas = calloc((size_t)n->capacity + 1, sizeof *n->cache_metas);
    n->cache_valid = calloc((size_t)n->capacity + 1, 1);
    if (!n->cache_names || !n->cache_metas || !n->cache_valid)
        return no_memory(n, "for the response cache");
    return RS_OK;
}

void rs_pending_free(rs_pending_t *p) {
    /* (a join still in progress is referenced by the negotiator; it is freed with the table) */
    if (!p)
        return;
    free(p->name);
    free(p->failure);
    free(p->metas);
    free(p->submitted);
    free(p->arrived_at);
    free(p);
}

void rs_negotiator_free(rs_negotiator_t *n) {
    for (size_t i = 0; i < n->pending.capacity; i++)
        if (n->pending.keys[i])
            rs_pending_free(n->pending.values[i]);
    rs_map_free(&n->pending);
    for (int i = 0; i < n->used; i++)
        free(n->cache_names[i]);
    free(n->cache_names);
    free(n->cache_metas);
    free(n->cache_valid);
    rs_map_free(&n->cache_ids);
    for (int i = 0; i < RS_FAILED_BLOCKING_KEEP; i++)
        free(n->failed_blocking_text[i]);
}

static int cacheable(int kind) {
    /* Gathers carry a per-rank first dimension, so their metadata differ by rank; a
     * message concerns two ranks, and unnamed ones are never named twice. */
    return kind != RS_KIND_ALLGATHER && kind != RS_KIND_ALLTOALL && kind != RS_KIND_JOIN &&
           kind != RS_KIND_SEND && kind != RS_KIND_REFUSED;
}

static int cache_id(const rs_negotiator_t *n, const char *name) {
    intptr_t id = (intptr_t)rs_map_get(&n->cache_ids, name);
    return id > 0 && n->cache_valid[id - 1] ? (int)id - 1 : -1;
}

void rs_negotiator_cache(rs_negotiator_t *n, const rs_pending_t *p) {
    int kind = p->metas[p->last_rank].kind; /* (a message's rank 0 may be no end of it) */
    if (!cacheable(kind) || p->count < n->size || n->used >= n->capacity ||
        cache_id(n, p->name) >= 0)
        return;
    char *name = strdup(p->name);
    if (!name || rs_map_put(&n->cache_ids, name, (void *)(intptr_t)(n->used + 1)) != 0) {
        free(name);
        return; /* without memory the tensor simply stays uncached */
    }
    n->cache_names[n->used] = name;
    n->cache_metas[n->used] = p->metas[0];
    n->cache_valid[n->used] = 1;
    n->used++;
}

/* ---- recording submissions ---- */

typedef struct {
    rs_pending_t **items;
    int count;
    int capacity;
} pending_list_t;

static int list_add(pending_list_t *l, rs_pending_t *p) {
    if (l->count == l->capacity) {
        int cap = l->capacity ? l->capacity * 2 : 16;
        rs_pending_t **grown = realloc(l->items, (size_t)cap * sizeof *grown);
        if (!grown)
            return -1;
        l->items = grown;
        l->capacity = cap;
    }
    l->items[l->count++] = p;
    return 0;
}

static int has_joined(const rs_negotiator_t *n, int r) {
    return n->join && n->join->submitted[r];
}

/* A rank joined: tensors that only waited for it may now be ready, so look at all. */
static rs_status_t join_recorded(rs_negotiator_t *n, rs_pending_t *join, pending_list_t *touched) {
    n->join = join;
    for (size_t i = 0; i < n->pending.capacity; i++)
        if (n->pending.keys[i] && list_add(touched, n->pending.values[i]) != 0)
            return no_memory(n, "recording a join");
    return RS_OK;
}

int rs_pending_is_p2p(const rs_pending_t *p) {
    return p->metas[p->last_rank].kind == RS_KIND_SEND;
}

/* Every rank has submitted p, or has joined (and will take part with zeros); a message:
 * its sender and its receiver have (a peer's metadata were range-checked on arrival). */
static int ready_everywhere(const rs_negotiator_t *n, rs_pending_t *p) {
    if (rs_pending_is_p2p(p)) {
        const rs_meta_t *m = &p->metas[p->last_rank];
        return p->submitted[m->root] && p->submitted[m->op];
    }
    if (p->count == n->size)
        return 1;
    if (p == n->join || !n->join)
        return 0;
    for (int r = 0; r < n->size; r++)
        if (!p->submitted[r] && !has_joined(n, r))
            return 0;
    return 1;
}

/* Joined ranks did not submit: give them the metadata of a rank that did. */
static void fill_joined_metas(const rs_negotiator_t *n, rs_pending_t *p) {
    int some = 0;
    while (!p->submitted[some])
        some++;
    for (int r = 0; r < n->size; r++)
        if (!p->submitted[r])
            p->metas[r] = p->metas[some];
}

static rs_pending_t *pending_for(rs_negotiator_t *n, const char *name, double now) {
    rs_pending_t *p = rs_map_get(&n->pending, name);
    if (p)
        return p;
    p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->name = strdup(name);
    p->metas = calloc((size_t)n->size, sizeof *p->metas);
    p->submitted = calloc((size_t)n->size, 1);
    p->arrived_at = calloc((size_t)n->size, sizeof *p->arrived_at);
    p->order = n->next_order++;
    p->first_seen = now;
    if (!p->name || !p->metas || !p->submitted || !p->arrived_at || rs_map_put(&n->pending, name, p) != 0) {
        rs_pending_free(p);
        return NULL;
    }
    return p;
}

/* Rank r submitted `name` with `meta`. Touched tensors are collected to check readiness. */
static rs_status_t record(rs_negotiator_t *n, int r, const char *name, const rs_meta_t *meta,
                          const rs_map_t *mine, pending_list_t *touched, double now) {
    rs_pending_t *p = pending_for(n, name, now);
    if (!p || list_add(touched, p) != 0)
        return no_memory(n, "recording a submission");
    if (!p->submitted[r]) {
        p->submitted[r] = 1;
        p->count++;
        p->arrived_at[r] = now;
        if (now != p->last_arrival) { /* (every rank's of one round share its `now`) */
            p->prev_arrival = p->last_arrival;
            p->last_arrival = now;
        }
    }
    p->metas[r] = *meta;
    p->last_rank = r;
    if (r == n->rank)
        p->mine = rs_map_get(mine, name);
    if (meta->kind == RS_KIND_JOIN)
        return join_recorded(n, p, touched);
    return RS_OK;
}

/* ---- wire format ---- */

/* Every rank's record of a round starts with this header; a record that does not carry
 * the magic, this round's number, this cache's size or a payload that hashes as announced
 * was misparsed or forged, and breaks the communicator instead of being believed. */
#define ROUND_MAGIC 0x52534e47u /* "RSNG" */
#define MAX_PAYLOAD_BYTES ((int64_t)1 << 30) /* one rank's uncached requests in one round */

typedef struct {
    uint32_t magic;
    uint32_t words;         /* bitset words that follow (the same on every rank) */
    uint64_t round;         /* rounds this negotiator ran before (the same on every rank) */
    uint64_t payload_bytes; /* uncached requests, sent in a second round */
    uint64_t payload_hash;  /* FNV-1a of those bytes */
    uint64_t blocking_seq;  /* this rank's oldest blocking call not yet run (0: none) */
    uint64_t blocking_hash; /* FNV-1a of its name */
    uint64_t report;        /* the newest hang report this rank knows of or asks for */
} round_header_t;

typedef struct {
    uint32_t name_len;
    uint32_t reserved;
    rs_meta_t meta;
} entry_header_t;

static size_t bitset_words(const rs_negotiator_t *n) { return ((size_t)n->used + 63) / 64; }

/* Split the batch into cache bits and serialized entries. */
static rs_status_t encode(const rs_negotiator_t *n, rs_work_t **batch, int nbatch,
                          uint64_t *bits, char **payload, size_t *payload_bytes) {
    size_t total = 0;
    for (int i = 0; i < nbatch; i++)
        total += sizeof(entry_header_t) + strlen(batch[i]->name);
    char *out = malloc(total ? total : 1), *at = out;
    if (!out)
        return no_memory(n, "encoding this rank's requests");
    for (int i = 0; i < nbatch; i++) {
        const rs_work_t *w = batch[i];
        int id = cache_id(n, w->name);
        if (id >= 0 && memcmp(&n->cache_metas[id], &w->meta, sizeof w->meta) == 0) {
            bits[id / 64] |= 1ULL << (id % 64);
            continue;
        }
        entry_header_t h = {(uint32_t)strlen(w->name), 0, w->meta};
        memcpy(at, &h, sizeof h);
        memcpy(at + sizeof h, w->name, h.name_len);
        at += sizeof h + h.name_len;
    }
    *payload = out;
    *payload_bytes = (size_t)(at - out);
    return RS_OK;
}

__attribute__((format(printf, 3, 4)))
static rs_status_t malformed(rs_comm_t *comm, int from, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return rs_fail(comm, RS_ERR_COMM, "rank %d: malformed negotiation message from rank %d "
                   "(%s); the communicator is broken", comm->rank, from, why);
}

static rs_status_t decode_bits(rs_comm_t *comm, rs_negotiator_t *n, int r, const uint64_t *bits,
                               size_t words, const rs_map_t *mine, pending_list_t *touched,
                               double now) {
    for (size_t w = 0; w < words; w++)
        for (uint64_t b = bits[w]; b; b &= b - 1) {
            int id = (int)(w * 64 + (size_t)__builtin_ctzll(b));
            if (id >= n->used)
                return malformed(comm, r, "cache id %d, but %d are in use", id, n->used);
            RS_CHECK(record(n, r, n->cache_names[id], &n->cache_metas[id], mine, touched, now));
        }
    return RS_OK;
}

static rs_status_t decode_entries(rs_comm_t *comm, rs_negotiator_t *n, int r, const char *data,
                                  size_t bytes, const rs_map_t *mine, pending_list_t *touched,
                                  double now) {
    const char *at = data, *end = data + bytes;
    char name[RS_MAX_NAME_LEN + 1];
    rs_error_t why;
    while (at < end) {
        entry_header_t h;
        if ((size_t)(end - at) < sizeof h)
            return malformed(comm, r, "%zu stray bytes after the last entry", (size_t)(end - at));
        memcpy(&h, at, sizeof h);
        at += sizeof h;
        if (h.name_len == 0 || h.name_len > RS_MAX_NAME_LEN || h.name_len > (size_t)(end - at) ||
            memchr(at, '\0', h.name_len))
            return malformed(comm, r, "a name of %u bytes with %zu left", h.name_len,
                             (size_t)(end - at));
        memcpy(name, at, h.name_len);
        name[h.name_len] = '\0';
        at += h.name_len;
        if (rs_meta_check(&h.meta, n->size, &why, NULL, NULL) != RS_OK)
            return malformed(comm, r, "tensor '%s': %s", name, why.text);
        int id = cache_id(n, name);
        if (id >= 0)
            n->cache_valid[id] = 0; /* its metadata changed: every rank drops it alike */
        RS_CHECK(record(n, r, name, &h.meta, mine, touched, now));
    }
    return RS_OK;
}

static int by_order(const void *a, const void *b) {
    int64_t x = (*(rs_pending_t *const *)a)->order, y = (*(rs_pending_t *const *)b)->order;
    return (x > y) - (x < y);
}

/* Tensors every rank has now submitted, each once, in first-appearance order. */
static rs_status_t collect_ready(rs_negotiator_t *n, pending_list_t *touched,
                                 rs_pending_t ***ready, int *nready) {
    rs_pending_t **out = malloc((size_t)(touched->count ? touched->count : 1) * sizeof *out);
    if (!out)
        return no_memory(n, "collecting the ready tensors");
    int k = 0;
    for (int i = 0; i < touched->count; i++) {
        rs_pending_t *p = touched->items[i];
        if ((p->failure || ready_everywhere(n, p)) && rs_map_get(&n->pending, p->name) == p) {
            rs_map_remove(&n->pending, p->name);
            n->my_blocking_pending -= p->mine && p->mine->blocking_seq;
            if (p->count < n->size && !rs_pending_is_p2p(p) && !p->failure)
                fill_joined_metas(n, p);
            if (p == n->join)
                n->join = NULL; /* every rank has joined: the join ends */
            out[k++] = p;
        }
    }
    qsort(out, (size_t)k, sizeof *out, by_order);
    *ready = out;
    *nready = k;
    return RS_OK;
}

/* The newest hang report any rank asked for becomes every rank's (a peer's word, but only
 * a number: the worst a forged one does is ask for a report). */
static void agree_on_report(rs_negotiator_t *n, const char *all, size_t record_bytes) {
    uint64_t newest = n->report;
    for (int r = 0; r < n->size; r++) {
        round_header_t h;
        memcpy(&h, all + (size_t)r * record_bytes, sizeof h);
        if (h.report > newest)
            newest = h.report;
    }
    n->report_new = newest > n->report;
    n->report = newest;
}

/* A rank's report field is the newest hang report it knows, or one it asks for: the newest
 * agreed plus one per ask since (stalls and requests, a handful between two rounds), for a
 * reason the engine knows. A number far ahead would block every later report (asks must
 * exceed it), and each forged one would have every rank write a report. */
#define MAX_REPORT_ASKS ((uint64_t)1 << 20)

static int report_plausible(const rs_negotiator_t *n, uint64_t report) {
    uint64_t reason = report & 0xff, id = report >> 8;
    return report == 0 || ((reason == RS_REPORT_STALL || reason == RS_REPORT_REQUEST) &&
                           id <= (n->report >> 8) + MAX_REPORT_ASKS);
}

static rs_status_t exchange(rs_comm_t *comm, rs_negotiator_t *n, const uint64_t *bits,
                            size_t words, const char *payload, size_t payload_bytes,
                            const uint64_t blocking[2], char **gathered_bits,
                            char **gathered_payload, int64_t **sizes) {
    size_t record_bytes = sizeof(round_header_t) + words * 8;
    char *mine = calloc(1, record_bytes);
    char *all = malloc(record_bytes * (size_t)n->size);
    int64_t *counts = malloc((size_t)n->size * sizeof *counts);
    *gathered_bits = all;
    *sizes = counts;
    *gathered_payload = NULL;
    if (!mine || !all || !counts) {
        free(mine);
        return no_memory(n, "gathering the round's headers");
    }
    round_header_t h = {ROUND_MAGIC, (uint32_t)words, n->rounds, payload_bytes,
                        rs_fnv1a(payload, payload_bytes), blocking[0], blocking[1],
                        n->report_ask > n->report ? n->report_ask : n->report};
    memcpy(mine, &h, sizeof h);
    memcpy(mine + sizeof h, bits, words * 8);
    for (int r = 0; r < n->size; r++)
        counts[r] = 1;
    rs_status_t st = rs_allgatherv(comm, mine, all, counts, record_bytes);
    free(mine);
    RS_CHECK(st);
    int64_t total = 0;
    for (int r = 0; r < n->size; r++) {
        memcpy(&h, all + (size_t)r * record_bytes, sizeof h);
        if (h.magic != ROUND_MAGIC || h.words != words || h.round != n->rounds)
            return malformed(comm, r, "header magic %#x, %u cache words, round %llu; expected "
                             "%#x, %zu, %llu", h.magic, h.words, (unsigned long long)h.round,
                             ROUND_MAGIC, words, (unsigned long long)n->rounds);
        if (!report_plausible(n, h.report))
            return malformed(comm, r, "hang report %llu for reason %u, but the newest is %llu",
                             (unsigned long long)(h.report >> 8), (unsigned)(h.report & 0xff),
                             (unsigned long long)(n->report >> 8));
        if (h.payload_bytes > (uint64_t)MAX_PAYLOAD_BYTES ||
            rs_add_checked(total, (int64_t)h.payload_bytes, &total) != 0)
            return malformed(comm, r, "announced %llu bytes of requests",
                             (unsigned long long)h.payload_bytes);
        counts[r] = (int64_t)h.payload_bytes;
    }
    n->rounds++;
    agree_on_report(n, all, record_bytes);
    if (total == 0)
        return RS_OK;
    /* Second round, only when some rank sent tensors the cache does not know. */
    if (!(*gathered_payload = malloc((size_t)total)))
        return no_memory(n, "gathering the round's requests");
    RS_CHECK(rs_allgatherv(comm, payload, *gathered_payload, counts, 1));
    const char *at = *gathered_payload;
    for (int r = 0; r < n->size; at += counts[r], r++) {
        memcpy(&h, all + (size_t)r * record_bytes, sizeof h);
        if (rs_fnv1a(at, (size_t)counts[r]) != h.payload_hash)
            return malformed(comm, r, "its %lld bytes of requests do not hash as announced",
                             (long long)counts[r]);
    }
    return RS_OK;
}

/* Record what every rank sent this round: cache bits, then new entries. */
static rs_status_t decode_round(rs_comm_t *comm, rs_negotiator_t *n, const char *gathered_bits,
                                const char *entries, const int64_t *sizes, size_t words,
                                const rs_map_t *mine, pending_list_t *touched) {
    double now = rs_now();
    size_t record_bytes = sizeof(round_header_t) + words * 8;
    for (int r = 0; r < n->size; r++) {
        const uint64_t *rank_bits = (const uint64_t *)(gathered_bits + (size_t)r * record_bytes +
                                                       sizeof(round_header_t));
        RS_CHECK(decode_bits(comm, n, r, rank_bits, words, mine, touched, now));
        if (sizes[r] > 0) {
            RS_CHECK(decode_entries(comm, n, r, entries, (size_t)sizes[r], mine, touched, now));
            entries += sizes[r];
        }
    }
    return RS_OK;
}

/* ---- blocking calls, matched in call order ----
 *
 * Each rank numbers its blocking calls of one tensor (rs_work_t.blocking_seq) and says in
 * every round which of them it waits for (the oldest not yet run) and its name's hash. Two
 * ranks waiting for their k-th blocking call under different names can never meet: every
 * rank sees it in the same gathered headers and fails both calls alike (and the k-th call
 * of a rank that makes it only later), so that the ranks' next calls are matched again. */

/* What this rank reports this round (out: the number and name hash of its oldest blocking
 * call not yet run), counting the batch's blocking calls as held from now on. */
static void oldest_blocking(rs_negotiator_t *n, rs_work_t **batch, int nbatch,
                            uint64_t out[2]) {
    const rs_work_t *oldest = NULL;
    for (int i = 0; i < nbatch; i++)
        if (batch[i]->blocking_seq && (!oldest || batch[i]->blocking_seq < oldest->blocking_seq))
            oldest = batch[i];
    /* (the scan of what negotiation holds only while some of it is a blocking call of
     * ours: a backward pass's hundreds of pending gradients are not) */
    for (size_t i = 0; n->my_blocking_pending > 0 && i < n->pending.capacity; i++) {
        const rs_pending_t *p = n->pending.keys[i] ? n->pending.values[i] : NULL;
        if (p && p->mine && p->mine->blocking_seq &&
            (!oldest || p->mine->blocking_seq < oldest->blocking_seq))
            oldest = p->mine;
    }
    for (int i = 0; i < nbatch; i++)
        n->my_blocking_pending += batch[i]->blocking_seq != 0;
    out[0] = oldest ? oldest->blocking_seq : 0;
    out[1] = oldest ? rs_fnv1a(oldest->name, strlen(oldest->name)) : 0;
}

static const round_header_t *header_of(const char *gathered, size_t record_bytes, int r) {
    return (const round_header_t *)(gathered + (size_t)r * record_bytes);
}

/* The pending tensor that rank r submitted under a name hashing to `hash`, or NULL. */
static rs_pending_t *submitted_by(const rs_negotiator_t *n, int r, uint64_t hash) {
    for (size_t i = 0; i < n->pending.capacity; i++) {
        rs_pending_t *p = n->pending.keys[i] ? n->pending.values[i] : NULL;
        if (p && p->submitted[r] && !rs_pending_is_p2p(p) &&
            rs_fnv1a(p->name, strlen(p->name)) == hash)
            return p;
    }
    return NULL;
}

static const char *failed_blocking_text(const rs_negotiator_t *n, uint64_t seq) {
    for (int i = 0; i < RS_FAILED_BLOCKING_KEEP; i++)
        if (n->failed_blocking[i] == seq && n->failed_blocking_text[i])
            return n->failed_blocking_text[i];
    return NULL;
}

static rs_status_t remember_failed_blocking(rs_negotiator_t *n, uint64_t seq, char *text) {
    int at = n->failed_blocking_next;
    free(n->failed_blocking_text[at]);
    n->failed_blocking[at] = seq;
    n->failed_blocking_text[at] = text;
    n->failed_blocking_next = (at + 1) % RS_FAILED_BLOCKING_KEEP;
    return RS_OK;
}

/* Fail the tensor rank r waits for as its blocking call (every rank does the same). */
static rs_status_t fail_blocking(rs_negotiator_t *n, int r, uint64_t hash, const char *text,
                                 pending_list_t *touched) {
    rs_pending_t *p = submitted_by(n, r, hash);
    if (!p || p->failure)
        return RS_OK;
    if (!(p->failure = strdup(text)) || list_add(touched, p) != 0)
        return no_memory(n, "failing a blocking call out of order");
    return RS_OK;
}

static char *out_of_order_text(const rs_negotiator_t *n, int a, uint64_t hash_a, int b,
                               uint64_t hash_b) {
    const rs_pending_t *pa = submitted_by(n, a, hash_a), *pb = submitted_by(n, b, hash_b);
    return rs_strdup_printf("Mismatched blocking collectives: rank %d called %s '%.200s', rank %d "
                            "called %s '%.200s' (every rank must make blocking collectives in "
                            "the same order)", a, pa ? rs_kind_name(pa->metas[a].kind) : "?",
                            pa ? pa->name : "?", b, pb ? rs_kind_name(pb->metas[b].kind) : "?",
                            pb ? pb->name : "?");
}

static rs_status_t check_blocking_order(rs_negotiator_t *n, const char *gathered,
                                        size_t record_bytes, pending_list_t *touched) {
    for (int a = 0; a < n->size; a++) {
        const round_header_t *ha = header_of(gathered, record_bytes, a);
        if (!ha->blocking_seq)
            continue;
        for (int b = a + 1; b < n->size; b++) {
            const round_header_t *hb = header_of(gathered, record_bytes, b);
            if (hb->blocking_seq != ha->blocking_seq || hb->blocking_hash == ha->blocking_hash)
                continue;
            char *text = out_of_order_text(n, a, ha->blocking_hash, b, hb->blocking_hash);
            if (!text)
                return no_memory(n, "wording blocking calls out of order");
            remember_failed_blocking(n, ha->blocking_seq, text);
            break;
        }
    }
    for (int r = 0; r < n->size; r++) { /* every rank waiting for a failed call fails it */
        const round_header_t *h = header_of(gathered, record_bytes, r);
        const char *text = h->blocking_seq ? failed_blocking_text(n, h->blocking_seq) : NULL;
        if (text)
            RS_CHECK(fail_blocking(n, r, h->blocking_hash, text, touched));
    }
    return RS_OK;
}

rs_status_t rs_negotiate(rs_comm_t *comm, rs_negotiator_t *n, rs_work_t **batch, int nbatch,
                         rs_pending_t ***ready, int *nready) {
    size_t words = bitset_words(n);
    uint64_t *bits = calloc(words ? words : 1, 8);
    rs_map_t mine = {0};
    char *payload = NULL, *gathered_bits = NULL, *gathered_payload = NULL;
    int64_t *sizes = NULL;
    pending_list_t touched = {0};
    size_t payload_bytes = 0;
    rs_status_t st;
    if (!bits || rs_map_reserve(&mine, (size_t)(nbatch > 0 ? nbatch : 0)) != 0)
        RS_CHECK_GOTO(no_memory(n, "for the cache bits"), st, out);
    for (int i = 0; i < nbatch; i++)
        if (rs_map_put(&mine, batch[i]->name, batch[i]) != 0)
            RS_CHECK_GOTO(no_memory(n, "indexing this rank's requests"), st, out);
    RS_CHECK_GOTO(encode(n, batch, nbatch, bits, &payload, &payload_bytes), st, out);
    uint64_t blocking[2];
    oldest_blocking(n, batch, nbatch, blocking);
    RS_CHECK_GOTO(exchange(comm, n, bits, words, payload, payload_bytes, blocking,
                           &gathered_bits, &gathered_payload, &sizes), st, out);
    RS_CHECK_GOTO(decode_round(comm, n, gathered_bits, gathered_payload, sizes, words, &mine,
                               &touched), st, out);
    RS_CHECK_GOTO(check_blocking_order(n, gathered_bits, sizeof(round_header_t) + words * 8,
                                       &touched), st, out);
    st = collect_ready(n, &touched, ready, nready);
out:
    if (st == RS_ERR_NOMEM) { /* recorded where it happened: keep the words, break comm */
        rs_error_t why;
        rs_comm_error(comm, &why);
        st = rs_fail(comm, RS_ERR_COMM, "%s", why.text);
    }
    free(bits);
    free(payload);
    free(gathered_bits);
    free(gathered_payload);
    free(sizes);
    free(touched.items);
    rs_map_free(&mine);
    return st;
}

/* ---- agreement across ranks ---- */

static void shape_text(const rs_meta_t *m, char *out, size_t cap) {
    size_t at = (size_t)snprintf(out, cap, "[");
    for (int d = 0; d < m->ndim && at < cap; d++)
        at += (size_t)snprintf(out + at, cap - at, d ? ", %lld" : "%lld", (long long)m->shape[d]);
    if (at < cap)
        snprintf(out + at, cap - at, "]");
}

static int shapes_agree(const rs_meta_t *a, const rs_meta_t *b) {
    if (a->ndim != b->ndim)
        return 0;
    /* Gathers may differ in the first dimension only. */
    int first = a->kind == RS_KIND_ALLGATHER || a->kind == RS_KIND_ALLTOALL ? 1 : 0;
    for (int d = first; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d])
            return 0;
    return 1;
}

static char *mismatch(const rs_pending_t *p, int r) {
    const rs_meta_t *a = &p->metas[0], *b = &p->metas[r];
    const char *kind = rs_kind_name(a->kind);
    if (a->kind != b->kind)
        return rs_strdup_printf("Mismatched operations for '%s': rank 0 sent %s, rank %d sent %s",
                                p->name, kind, r, rs_kind_name(b->kind));
    if (a->dtype != b->dtype)
        return rs_strdup_printf("Mismatched %s dtypes for '%s': rank 0 sent %s, rank %d sent %s",
                                kind, p->name, rs_dtype_name(a->dtype), r, rs_dtype_name(b->dtype));
    if (!shapes_agree(a, b)) {
        char sa[256], sb[256];
        shape_text(a, sa, sizeof sa);
        shape_text(b, sb, sizeof sb);
        return rs_strdup_printf("Mismatched %s tensor shapes for '%s': rank 0 sent %s, rank %d "
                                "sent %s%s", kind, p->name, sa, r, sb,
                                a->kind == RS_KIND_ALLGATHER || a->kind == RS_KIND_ALLTOALL
                                    ? " (only the first dimension may differ)" : "");
    }
    if (a->op != b->op)
        return rs_strdup_printf("Mismatched %s reduction ops for '%s': rank 0 sent %s, rank %d "
                                "sent %s", kind, p->name, rs_op_name(a->op), r, rs_op_name(b->op));
    if (a->root != b->root)
        return rs_strdup_printf("Mismatched %s root ranks for '%s': rank 0 sent %d, rank %d sent %d",
                                kind, p->name, a->root, r, b->root);
    if (a->prescale != b->prescale || a->postscale != b->postscale)
        return rs_strdup_printf("Mismatched %s scale factors for '%s': rank 0 sent prescale %g "
                                "postscale %g, rank %d sent prescale %g postscale %g", kind,
                                p->name, a->prescale, a->postscale, r, b->prescale, b->postscale);
    return NULL;
}

/* Every rank's rows fit, but their sum might not (ranks agree on the result: the same
 * metadata is checked everywhere). */
static char *gather_too_large(const rs_pending_t *p, int size) {
    int64_t row_bytes = (int64_t)rs_dtype_size(p->metas[0].dtype), total = 0, bytes;
    for (int d = 1; d < p->metas[0].ndim; d++)
        row_bytes *= p->metas[0].shape[d]; /* within one rank's checked size */
    for (int r = 0; r < size; r++)
        if (rs_mul_checked(p->metas[r].shape[0], row_bytes, &bytes) != 0 ||
            rs_add_checked(total, bytes, &total) != 0)
            return rs_strdup_printf("allgather '%s': the ranks' rows add up to more than %lld "
                                    "bytes (rank %d sent %lld rows)", p->name,
                                    (long long)RS_MAX_BYTES, r, (long long)p->metas[r].shape[0]);
    return NULL;
}

/* A message: its two ends name the same sender and receiver (no third rank posted it),
 * and the receiver's buffer has the sender's dtype and shape. */
static char *p2p_mismatch(const rs_pending_t *p, int size) {
    const rs_meta_t *m = &p->metas[p->last_rank];
    const rs_meta_t *s = &p->metas[m->root], *r = &p->metas[m->op];
    for (int k = 0; k < size; k++)
        if (p->submitted[k] && (k != m->root && k != m->op))
            return rs_strdup_printf("message '%s': rank %d posted it too, but it goes from "
                                    "rank %d to rank %d", p->name, k, m->root, m->op);
    if (s->kind != RS_KIND_SEND || r->kind != RS_KIND_SEND || s->root != r->root ||
        s->op != r->op)
        return rs_strdup_printf("message '%s': ranks %d and %d disagree on what it is", p->name,
                                m->root, m->op);
    if (s->dtype != r->dtype)
        return rs_strdup_printf("Mismatched send/recv dtypes for '%s': rank %d sends %s, rank "
                                "%d receives into %s", p->name, m->root, rs_dtype_name(s->dtype),
                                m->op, rs_dtype_name(r->dtype));
    if (!shapes_agree(s, r)) {
        char ss[256], sr[256];
        shape_text(s, ss, sizeof ss);
        shape_text(r, sr, sizeof sr);
        return rs_strdup_printf("Mismatched send/recv shapes for '%s': rank %d sends %s, rank %d "
                                "receives into %s", p->name, m->root, ss, m->op, sr);
    }
    return NULL;
}

/* A rank refused the call (its own checks failed; see rs_engine_refuse): every rank fails
 * it, naming the first rank that refused. */
static char *refused(const rs_pending_t *p, int size) {
    int by = -1, kind = -1;
    for (int r = 0; r < size; r++) {
        if (!p->submitted[r])
            continue;
        if (p->metas[r].kind == RS_KIND_REFUSED && by < 0)
            by = r;
        else if (p->metas[r].kind != RS_KIND_REFUSED && kind < 0)
            kind = p->metas[r].kind;
    }
    if (by < 0)
        return NULL;
    return rs_strdup_printf("%s '%s' was refused on rank %d: its arguments failed a check "
                            "there (that rank's error says which)",
                            rs_kind_name(kind >= 0 ? kind : p->metas[by].root), p->name, by);
}

char *rs_check_agreement(const rs_pending_t *p, int size) {
    if (p->failure)
        return rs_strdup_printf("%s", p->failure);
    char *refusal = refused(p, size);
    if (refusal)
        return refusal;
    if (rs_pending_is_p2p(p))
        return p2p_mismatch(p, size);
    if (p->count < size && p->metas[0].kind != RS_KIND_ALLREDUCE) {
        char joined[512];
        rs_pending_ranks(p, size, 0, joined, sizeof joined);
        return rs_strdup_printf("%s '%s' cannot run while ranks %s have joined: only allreduce "
                                "works with join", rs_kind_name(p->metas[0].kind), p->name, joined);
    }
    for (int r = 1; r < size; r++) {
        char *message = mismatch(p, r);
        if (message)
            return message;
    }
    return p->metas[0].kind == RS_KIND_ALLGATHER ? gather_too_large(p, size) : NULL;
}

/* ---- stalls ---- */

void rs_pending_ranks(const rs_pending_t *p, int size, int want, char *out, size_t cap) {
    if (!want && rs_pending_is_p2p(p)) { /* only the message's two ends are awaited */
        const rs_meta_t *m = &p->metas[p->last_rank];
        unsigned char *flags = calloc((size_t)size, 1);
        if (flags) {
            flags[m->root] = !p->submitted[m->root];
            flags[m->op] = !p->submitted[m->op];
            rs_format_ranks(flags, size, 1, out, cap);
            free(flags);
            return;
        }
    }
    rs_format_ranks(p->submitted, size, want, out, cap);
}

int rs_pending_waits(const rs_pending_t *p, int size, double *waits) {
    if (p->count < size || p->failure || rs_pending_is_p2p(p) ||
        p->metas[p->last_rank].kind == RS_KIND_JOIN)
        return 0;
    double wait = p->prev_arrival > 0 ? p->last_arrival - p->prev_arrival : 0;
    for (int r = 0; r < size && wait > 0; r++)
        if (p->arrived_at[r] == p->last_arrival && waits[r] < wait)
            waits[r] = wait;
    return 1;
}

double rs_negotiator_stalls(rs_negotiator_t *n, double now, double after, int *reported) {
    double next_due = 0;
    *reported = 0;
    for (size_t i = 0; i < n->pending.capacity; i++) {
        rs_pending_t *p = n->pending.keys[i] ? n->pending.values[i] : NULL;
        if (!p || p->stall_reported || p == n->join)
            continue; /* ranks that joined wait for the others by design */
        double due = p->first_seen + after;
        if (now >= due) {
            char have[512], missing[512];
            int some = 0;
            while (!p->submitted[some])
                some++;
            rs_pending_ranks(p, n->size, 1, have, sizeof have);
            rs_pending_ranks(p, n->size, 0, missing, sizeof missing);
            rs_report_stall(p->name, p->metas[some].kind, have, missing, now - p->first_seen);
            p->stall_reported = 1;
            (*reported)++;
        } else if (next_due == 0 || due < next_due) {
            next_due = due;
        }
    }
    return next_due;
}
