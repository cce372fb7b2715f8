/* Timeline: Chrome-trace JSON (opens in Perfetto / chrome://tracing). One track per
 * tensor (a "thread" named after it) inside one process per rank; complete events
 * ("ph":"X") for each phase of the tensor's life.
 *
 * Names follow Horovod's timeline, so that what a Horovod user looks for is there: a
 * track is named `<kind>.<name>` (Horovod's name for a tensor: `allreduce.grad.w`; unnamed
 * ones are `allreduce.noname.<n>` already), a tensor's phases are NEGOTIATE_ALLREDUCE,
 * ALLREDUCE (the collective; on the same-host lane too, marked "path": "lane"),
 * MEMCPY_IN_FUSION_BUFFER and MEMCPY_OUT_FUSION_BUFFER. */
#define _GNU_SOURCE
#include <ctype.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "timeline.h"

void rs_timeline_init(rs_timeline_t *t, int rank) {
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    t->rank = rank;
}

static void write_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void begin_event(rs_timeline_t *t) {
    fputs(t->events++ ? ",\n" : "\n", t->file);
}

/* Open for writing, refusing a symbolic link at `path`: in a shared directory someone
 * else may have planted one to make us overwrite a file of theirs choosing. */
static FILE *open_no_follow(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return NULL;
    FILE *f = fdopen(fd, "w");
    if (!f)
        close(fd);
    return f;
}

rs_status_t rs_timeline_start(rs_timeline_t *t, const char *path, int mark_cycles) {
    pthread_mutex_lock(&t->mu);
    rs_status_t st = RS_OK;
    if (t->file) {
        st = RS_ERR_USAGE; /* one timeline at a time */
    } else if (!(t->file = open_no_follow(path))) {
        st = RS_ERR_SYSTEM;
    } else {
        t->events = 0;
        t->mark_cycles = mark_cycles;
        fprintf(t->file, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [");
        begin_event(t);
        fprintf(t->file, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, "
                "\"args\": {\"name\": \"rank %d\"}}", t->rank, t->rank);
    }
    pthread_mutex_unlock(&t->mu);
    return st;
}

void rs_timeline_stop(rs_timeline_t *t) {
    pthread_mutex_lock(&t->mu);
    if (t->file) {
        fprintf(t->file, "\n]}\n");
        fclose(t->file);
        t->file = NULL;
    }
    rs_map_free(&t->tids);
    t->next_tid = 0;
    pthread_mutex_unlock(&t->mu);
}

/* "ALLREDUCE" for an allreduce (at most `cap` - 1 characters). */
static void upper_kind(int kind, char *out, size_t cap) {
    const char *name = rs_kind_name(kind);
    size_t i = 0;
    for (; name[i] && i + 1 < cap; i++)
        out[i] = name[i] == ' ' ? '_' : (char)toupper((unsigned char)name[i]);
    out[i] = '\0';
}

/* Horovod's name for the tensor: `<kind>.<name>`, unless name already starts so. Caller
 * frees. */
static char *track_name(int kind, const char *name) {
    const char *prefix = rs_kind_name(kind);
    size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) == 0 && name[n] == '.')
        return strdup(name);
    return rs_strdup_printf("%s.%s", prefix, name);
}

static int track_of(rs_timeline_t *t, const char *tensor) {
    intptr_t tid = (intptr_t)rs_map_get(&t->tids, tensor);
    if (tid)
        return (int)tid;
    tid = ++t->next_tid;
    if (rs_map_put(&t->tids, tensor, (void *)tid) != 0)
        return 0;
    begin_event(t);
    fprintf(t->file, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
            "\"args\": {\"name\": ", t->rank, (int)tid);
    write_json_string(t->file, tensor);
    fputs("}}", t->file);
    return (int)tid;
}

void rs_timeline_counter(rs_timeline_t *t, const char *name, int series_rank, double value,
                         double now) {
    pthread_mutex_lock(&t->mu);
    if (t->file) {
        begin_event(t);
        fputs("{\"name\": ", t->file);
        write_json_string(t->file, name);
        fprintf(t->file, ", \"ph\": \"C\", \"pid\": %d, \"ts\": %.3f, "
                "\"args\": {\"rank %d\": %.3f}}", t->rank, now * 1e6, series_rank, value);
    }
    pthread_mutex_unlock(&t->mu);
}

void rs_timeline_cycle(rs_timeline_t *t, double now) {
    pthread_mutex_lock(&t->mu);
    if (t->file && t->mark_cycles) {
        begin_event(t);
        fprintf(t->file, "{\"name\": \"CYCLE_START\", \"ph\": \"i\", \"s\": \"p\", "
                "\"pid\": %d, \"tid\": 0, \"ts\": %.3f}", t->rank, now * 1e6);
    }
    pthread_mutex_unlock(&t->mu);
}

/* A phase's event name: fixed, or made from the collective's kind (NULL here). */
static const char *const FIXED_PHASE_NAMES[] = {
    [RS_SPAN_COPY_IN] = "MEMCPY_IN_FUSION_BUFFER", [RS_SPAN_COPY_OUT] = "MEMCPY_OUT_FUSION_BUFFER",
    [RS_SPAN_SEND] = "SEND", [RS_SPAN_RECV] = "RECV"};

static void phase_name(rs_span_t phase, int kind, char *out, size_t cap) {
    char upper[32];
    upper_kind(kind, upper, sizeof upper);
    if (phase == RS_SPAN_NEGOTIATE)
        snprintf(out, cap, "NEGOTIATE_%s", upper);
    else
        snprintf(out, cap, "%s", FIXED_PHASE_NAMES[phase] ? FIXED_PHASE_NAMES[phase] : upper);
}

void rs_timeline_span(rs_timeline_t *t, int kind, const char *name, rs_span_t phase,
                      double start, double end) {
    char *track = track_name(kind, name), what[64];
    phase_name(phase, kind, what, sizeof what);
    pthread_mutex_lock(&t->mu);
    if (t->file && track) {
        int tid = track_of(t, track);
        begin_event(t);
        fprintf(t->file, "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, "
                "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"tensor\": ", what, t->rank, tid,
                start * 1e6, (end - start) * 1e6);
        write_json_string(t->file, track);
        fputs(phase == RS_SPAN_LANE ? ", \"path\": \"lane\"}}" : "}}", t->file);
    }
    pthread_mutex_unlock(&t->mu);
    free(track);
}
