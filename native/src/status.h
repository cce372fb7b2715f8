/* The one way errors travel in the native core: a status code, and a record of the code
 * with its text. A function that fails returns the code; the words go into the record of
 * the actor that failed (see "Who touches what" in internal.h for which records exist
 * and which thread writes each). The record's functions live in status.c, at the bottom
 * of the core, so every file may use them. */
#ifndef RINGSYNC_STATUS_H
#define RINGSYNC_STATUS_H

#include <stdarg.h>

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
