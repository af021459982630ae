/* A stand-in for libcupti's activity-buffer entry points, for the CPU tests of
 * graphtree/profile/_rawbuf.py (the ctypes signatures, the pool, CUPTI's record iterator).
 * Built by tests/test_profile_rawbuf.py with the C compiler when there is one:
 *     cc -shared -fPIC -o libcupti_stub.so libcupti_stub.c
 * Records are appended as raw bytes (stub_emit) and delivered on cuptiActivityFlushAll into a
 * buffer obtained from the registered "requested" callback. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*req_fn)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*done_fn)(void *ctx, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid);

static req_fn g_req;
static done_fn g_done;
static uint8_t *g_pending;
static size_t g_pending_len;
static size_t g_sizes[128];
static uint32_t g_enabled[128];
static uint32_t g_period;
static int g_dropped;

int cuptiActivityRegisterCallbacks(req_fn r, done_fn d) { g_req = r; g_done = d; return 0; }
int cuptiActivityEnable(int kind) { if (kind < 0 || kind >= 128) return 1; g_enabled[kind] = 1; return 0; }
int cuptiActivityDisable(int kind) { if (kind < 0 || kind >= 128) return 1; g_enabled[kind] = 0; return 0; }
int cuptiActivityFlushPeriod(uint32_t ms) { g_period = ms; return 0; }
uint32_t stub_flush_period(void) { return g_period; }
int stub_enabled(int kind) { return (int)g_enabled[kind]; }
int stub_dropped(void) { return g_dropped; }
void stub_set_size(uint32_t kind, size_t size) { if (kind < 128) g_sizes[kind] = size; }

void stub_emit(const uint8_t *data, size_t n) {
    g_pending = realloc(g_pending, g_pending_len + n);
    memcpy(g_pending + g_pending_len, data, n);
    g_pending_len += n;
}

int cuptiActivityFlushAll(uint32_t flag) {
    (void)flag;
    if (!g_req || !g_done) return 15;
    while (g_pending_len) {
        uint8_t *buf = NULL; size_t size = 0, maxr = 0;
        g_req(&buf, &size, &maxr);
        if (!buf || !size) { g_dropped++; g_pending_len = 0; return 0; }
        /* whole records only */
        size_t used = 0;
        while (used < g_pending_len) {
            uint32_t kind; memcpy(&kind, g_pending + used, 4);
            size_t s = kind < 128 ? g_sizes[kind] : 0;
            if (!s || used + s > size) break;
            used += s;
        }
        memcpy(buf, g_pending, used);
        memmove(g_pending, g_pending + used, g_pending_len - used);
        g_pending_len -= used;
        g_done(NULL, 0, buf, size, used);
        if (!used) break;
    }
    return 0;
}

int cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, void **record) {
    uint8_t *cur = (uint8_t *)*record;
    size_t off;
    if (!cur) off = 0;
    else {
        uint32_t kind; memcpy(&kind, cur, 4);
        off = (size_t)(cur - buffer) + g_sizes[kind < 128 ? kind : 0];
    }
    if (off >= valid) return 12; /* CUPTI_ERROR_MAX_LIMIT_REACHED */
    *record = buffer + off;
    return 0;
}
