/* The compact formats' CPU kernels (tierswap.optim.formats._native builds and loads this file).
 *
 * The same arithmetic as the torch ops of _quant8.py and _remainder.py, in one pass instead of
 * a dozen (8-bit encode) or a few strided ones (remainders):
 * - 8-bit encode: a block's absmax, then each value divided by it (IEEE division, so the
 *   quotient is the one torch computes) and coded by one look-up in the 65,536-entry offset
 *   table of _quant8._code_offsets; decode: one look-up in the 256-entry map, one multiply;
 * - remainders: a master's upper half plus its rounding carry (bf16's NaN for a NaN) and its
 *   lower half; join puts the two halves back.
 * Plain C99 and POSIX threads, built with the compiler's default target: no OpenMP runtime
 * beside torch's, no instruction set the machine may lack. */

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 16
#define MIN_PER_THREAD 65536 /* elements */
#define SPAN 1024            /* elements divided at once, so the loop vectorises */
#define BF16_NAN 0x7FC0

static const float SCALE_FLOOR = 1.17549435e-38f; /* the smallest normal fp32 */

/* The largest magnitude of x[0..n): non-negative floats order as their bits do, and every NaN
 * lies above inf, so an integer maximum (which vectorises) finds it; a NaN gives one NaN. */
static float block_absmax(const float *x, int64_t n) {
    int32_t top = 0;
    for (int64_t i = 0; i < n; ++i) {
        int32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        bits &= 0x7FFFFFFF;
        top = bits > top ? bits : top;
    }
    if (top > 0x7F800000) top = 0x7FC00000;
    float m;
    memcpy(&m, &top, sizeof m);
    return m < SCALE_FLOOR ? SCALE_FLOOR : m; /* false for NaN, which stays */
}

static void encode_range(const float *x, int64_t n, int64_t bs, const int32_t *offsets,
                         uint8_t *codes, float *absmax) {
    float y[SPAN];
    int32_t bits[SPAN];
    for (int64_t lo = 0, b = 0; lo < n; lo += bs, ++b) {
        int64_t hi = lo + bs < n ? lo + bs : n;
        float m = block_absmax(x + lo, hi - lo);
        absmax[b] = m;
        for (int64_t s = lo; s < hi; s += SPAN) {
            int64_t len = hi - s < SPAN ? hi - s : SPAN;
            for (int64_t i = 0; i < len; ++i) y[i] = x[s + i] / m;
            memcpy(bits, y, (size_t)len * sizeof *y);
            /* _quant8._code_offsets: the code is the third byte of (k + offsets[h]), where h
             * is the upper half and k the bits, complemented for a negative value */
            for (int64_t i = 0; i < len; ++i) {
                int32_t v = bits[i];
                codes[s + i] = (uint8_t)(((v ^ (v >> 31)) + offsets[(uint32_t)v >> 16]) >> 16);
            }
        }
    }
}

static void decode_range(const uint8_t *codes, const float *absmax, int64_t n, int64_t bs,
                         const float *qmap, float *out) {
    for (int64_t lo = 0, b = 0; lo < n; lo += bs, ++b) {
        int64_t hi = lo + bs < n ? lo + bs : n;
        float s = absmax[b];
        for (int64_t i = lo; i < hi; ++i) out[i] = qmap[codes[i]] * s;
    }
}

/* The bf16 bits of a master rounded half up: its upper half, one bf16 step further from zero
 * where the lower half is >= 0x8000 (the carry may wrap, as the int16 ops do); bf16's NaN for
 * a NaN master. */
static inline uint16_t rounded_upper(uint32_t b) {
    uint16_t p = (uint16_t)((b >> 16) + ((b >> 15) & 1u));
    return (b & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)BF16_NAN : p;
}

/* param = rounded_upper(master), remainder (if any) = the master's lower half; one pass */
static void split_range(const uint32_t *master, int64_t n, uint16_t *param, int16_t *remainder) {
    if (remainder) {
        for (int64_t i = 0; i < n; ++i) {
            param[i] = rounded_upper(master[i]);
            remainder[i] = (int16_t)(uint16_t)master[i];
        }
    } else {
        for (int64_t i = 0; i < n; ++i) param[i] = rounded_upper(master[i]);
    }
}

/* master bits = (param << 16) + remainder, modulo 2**32 as the int32 ops compute it */
static void join_range(const uint16_t *param, const int16_t *remainder, int64_t n,
                       uint32_t *master) {
    for (int64_t i = 0; i < n; ++i)
        master[i] = ((uint32_t)param[i] << 16) + (uint32_t)(int32_t)remainder[i];
}

enum kind { ENCODE_8BIT, DECODE_8BIT, SPLIT, JOIN };

/* One call's arrays: a and b are read, c and d written (see run_share for each kind); per
 * block arrays (absmax) have one entry per bs elements. */
typedef struct {
    enum kind kind;
    const void *a, *b, *table;
    void *c, *d;
    int64_t n, bs;
} call_t;

/* One thread's share of a call: elements [lo, hi), lo a multiple of bs. */
typedef struct {
    const call_t *call;
    int64_t lo, hi;
} share_t;

static void *run_share(void *arg) {
    const share_t *s = arg;
    const call_t *c = s->call;
    int64_t lo = s->lo, n = s->hi - s->lo, block = lo / c->bs;
    switch (c->kind) {
    case ENCODE_8BIT:
        encode_range((const float *)c->a + lo, n, c->bs, c->table, (uint8_t *)c->c + lo,
                     (float *)c->d + block);
        break;
    case DECODE_8BIT:
        decode_range((const uint8_t *)c->a + lo, (const float *)c->b + block, n, c->bs, c->table,
                     (float *)c->c + lo);
        break;
    case SPLIT:
        split_range((const uint32_t *)c->a + lo, n, (uint16_t *)c->c + lo,
                    c->d ? (int16_t *)c->d + lo : NULL);
        break;
    case JOIN:
        join_range((const uint16_t *)c->a + lo, (const int16_t *)c->b + lo, n,
                   (uint32_t *)c->c + lo);
        break;
    }
    return NULL;
}

/* Runs a call in shares of whole blocks, one per thread (the caller's included), each of at
 * least MIN_PER_THREAD elements; a thread that cannot be started has its share run by the
 * caller, so the call always completes. */
static void run(const call_t *call, int threads) {
    int64_t blocks = (call->n + call->bs - 1) / call->bs;
    int64_t most = call->n / MIN_PER_THREAD;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > most) threads = most > 1 ? (int)most : 1;
    share_t shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; ++t) {
        int64_t lo = blocks * t / threads * call->bs, hi = blocks * (t + 1) / threads * call->bs;
        shares[t] = (share_t){call, lo, hi < call->n ? hi : call->n};
    }
    for (int t = 1; t < threads; ++t)
        started[t] = pthread_create(&ids[t], NULL, run_share, &shares[t]) == 0;
    run_share(&shares[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_share(&shares[t]);
    }
}

void tierswap_encode_8bit(const float *x, int64_t n, int64_t bs, const int32_t *offsets,
                          uint8_t *codes, float *absmax, int threads) {
    call_t call = {ENCODE_8BIT, x, NULL, offsets, codes, absmax, n, bs};
    run(&call, threads);
}

void tierswap_decode_8bit(const uint8_t *codes, const float *absmax, int64_t n, int64_t bs,
                          const float *qmap, float *out, int threads) {
    call_t call = {DECODE_8BIT, codes, absmax, qmap, out, NULL, n, bs};
    run(&call, threads);
}

void tierswap_split(const uint32_t *master, int64_t n, uint16_t *param, int16_t *remainder,
                    int threads) {
    call_t call = {SPLIT, master, NULL, NULL, param, remainder, n, 1};
    run(&call, threads);
}

void tierswap_join(const uint16_t *param, const int16_t *remainder, int64_t n, uint32_t *master,
                   int threads) {
    call_t call = {JOIN, param, remainder, NULL, master, NULL, n, 1};
    run(&call, threads);
}
