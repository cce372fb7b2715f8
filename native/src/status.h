/* The one way errors travel in the native core: a status code, and a record of the code
 * with its text. A function that fails returns the code; the words go into the record of
 * the actor that failed (see "Who touches what" in comm.h for which records exist and
 * which thread writes each). The record's functions, the communicator's record among
 * them, live in status.c, at the bottom of the core, so every file may use them. */
#ifndef RINGSYNC_STATUS_H
#define RINGSYNC_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#include "ringsync.h"

#define RS_ERROR_LEN 1024

/* An error: what went wrong (RS_OK: nothing recorded) and what to tell the user. */
typedef struct {
    rs_status_t code;
    char text[RS_ERROR_LEN];
} rs_error_t;

/* Record `code` and the formatted text in *err; returns code, so that a failing function
 * can end with `return rs_error_set(...)`. */
rs_status_t rs_error_set(rs_error_t *err, rs_status_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
rs_status_t rs_error_vset(rs_error_t *err, rs_status_t code, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));
/* Copy *from into *to; returns the copied code. */
rs_status_t rs_error_copy(rs_error_t *to, const rs_error_t *from);
void rs_error_clear(rs_error_t *err);

/* ---- the communicator's record (comm.h's `error`), and the words written once ---- */

/* Record an error in words; recoverable kinds also mark the communicator broken. */
rs_status_t rs_fail(rs_comm_t *comm, rs_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A consistent copy of the communicator's error record (another thread may be writing
 * it); returns its code. */
rs_status_t rs_comm_error(rs_comm_t *comm, rs_error_t *out);
const char *rs_peer_host(const rs_comm_t *comm, int peer);
double rs_now(void);
/* The words for how a wait ends, shared by the engine, the negotiation, the transports and
 * the lane: a peer lost (or aborted after a failure elsewhere); a stall report (printed
 * on stderr); a tensor that some ranks never submitted within the timeout. */
/* Why `peer` is gone: lost, or aborted (then `reported`, when >= 0, is the rank it said
 * was lost, named first). */
void rs_peer_gone_text(const rs_comm_t *comm, int peer, int aborted, int reported, char *out,
                       size_t cap);
/* Remember `peer` as the lost one, unless another was found first (any thread). */
void rs_note_lost(rs_comm_t *comm, int peer);
void rs_report_stall(const char *name, int kind, const char *have, const char *missing,
                     double waited);
void rs_submit_timeout_text(const rs_comm_t *comm, const char *name, int kind, double waited,
                            const char *missing, char *out, size_t cap);
/* The communicator's scratch space, grown to `bytes` (a failure is recorded). */
rs_status_t rs_scratch(rs_comm_t *comm, size_t bytes, void **out);

/* Propagate a non-OK status to the caller (NCCL-style check macro). */
#define RS_CHECK(expr)                       \
    do {                                     \
        rs_status_t rs_check_st_ = (expr);   \
        if (rs_check_st_ != RS_OK)           \
            return rs_check_st_;             \
    } while (0)

/* Keep a non-OK status in `st` and jump to `label`, where the function frees what it
 * holds and returns st. */
#define RS_CHECK_GOTO(expr, st, label) \
    do {                               \
        (st) = (expr);                 \
        if ((st) != RS_OK)             \
            goto label;                \
    } while (0)

#endif
