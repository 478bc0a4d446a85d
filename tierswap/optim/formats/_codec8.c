/* The 8-bit codec's CPU kernels (tierswap.optim.formats._native builds and loads this file).
 *
 * The same arithmetic as the torch ops of _quant8.py, in one pass per block instead of a dozen
 * passes over the whole piece: a block's absmax, then each value divided by it (IEEE division,
 * so the quotient is the one torch computes) and coded by one look-up in the 65,536-entry
 * offset table of _quant8._code_offsets. Decode is one look-up in the 256-entry map and one
 * multiply. Plain C99 and POSIX threads, built with the compiler's default target: no OpenMP
 * runtime beside torch's, no instruction set the machine may lack. */

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 16
#define MIN_BLOCKS_PER_THREAD 256 /* 64 Ki elements of 256-element blocks */
#define SPAN 1024                 /* elements divided at once, so the loop vectorises */

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

/* One thread's share: whole blocks [b0, b1) of the call. */
typedef struct {
    int encode;
    const void *src;
    const float *absmax_in;
    const void *table;
    void *dst;
    float *absmax_out;
    int64_t n, bs;
} share_t;

static void *run_share(void *arg) {
    share_t *s = arg;
    if (s->encode)
        encode_range(s->src, s->n, s->bs, s->table, s->dst, s->absmax_out);
    else
        decode_range(s->src, s->absmax_in, s->n, s->bs, s->table, s->dst);
    return NULL;
}

/* Splits the call into whole-block shares, one per thread (the caller's included); a thread
 * that cannot be started has its share run by the caller, so the call always completes. */
static void run_split(share_t whole, int threads, int64_t src_size, int64_t dst_size) {
    int64_t blocks = (whole.n + whole.bs - 1) / whole.bs;
    int64_t most = blocks / MIN_BLOCKS_PER_THREAD;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > most) threads = most > 1 ? (int)most : 1;
    share_t shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; ++t) {
        int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        int64_t lo = b0 * whole.bs, hi = b1 * whole.bs < whole.n ? b1 * whole.bs : whole.n;
        share_t s = whole;
        s.n = hi - lo;
        s.src = (const char *)whole.src + lo * src_size;
        s.dst = (char *)whole.dst + lo * dst_size;
        if (s.absmax_in) s.absmax_in += b0;
        if (s.absmax_out) s.absmax_out += b0;
        shares[t] = s;
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
    share_t whole = {1, x, NULL, offsets, codes, absmax, n, bs};
    run_split(whole, threads, sizeof(float), sizeof(uint8_t));
}

void tierswap_decode_8bit(const uint8_t *codes, const float *absmax, int64_t n, int64_t bs,
                          const float *qmap, float *out, int threads) {
    share_t whole = {0, codes, absmax, qmap, out, NULL, n, bs};
    run_split(whole, threads, sizeof(uint8_t), sizeof(float));
}
