/* Decode attention straight over the paged KV cache: one query token per row, its context read block by
 * block through the row's block table, with no gathered copy of K and V (backends/kernels/paged_attention.py
 * builds and loads this; backends/models/llama.py calls it on a CPU in float32).
 *
 * Layouts (all contiguous, float32):
 *   q    [rows, heads, head_dim]               the decode rows' queries, RoPE applied
 *   k, v [slots, kv_heads, head_dim]           one layer's cache; slot = block * block_size + offset
 *   table [rows, max_blocks] int64             each row's blocks in context order (padding unread)
 *   lens [rows] int64                          each row's context length, its new token included
 *   out  [rows, heads, head_dim]
 * Query head j reads KV head j / (heads / kv_heads) (grouped-query attention). Each (row, KV head) is one
 * work item: its group of query heads is scored against every context token (one pass over K), softmaxed,
 * and then weights V (one pass over V). Work items are shared among `threads` OpenMP threads by stride;
 * the caller's OpenMP runtime (torch's) runs them, so nothing here outlives the call. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

/* Eight floats as one value: GCC and Clang map it to one AVX register, or two SSE or NEON registers. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* the same, at any float's address */

/* Token t's row of a layer's K or V. The block size is a power of two in practice (the engine's default is
 * 64): a shift and a mask then, where a 64-bit division per token would cost more than the token's math. */
static inline const float *_token(const float *cache, const int64_t *blocks, int64_t t, int64_t block_size,
                                  int64_t token_stride) {
    int64_t block, offset;
    if ((block_size & (block_size - 1)) == 0) {
        block = t >> __builtin_ctzll((unsigned long long)block_size);
        offset = t & (block_size - 1);
    } else {
        block = t / block_size;
        offset = t % block_size;
    }
    return cache + (blocks[block] * block_size + offset) * token_stride;
}

/* Dot product of `chunks` * 8 floats, in two chains so the adds overlap. */
static inline __attribute__((always_inline)) float _dot(const float *x, const float *y, const int64_t chunks) {
    v8 a = {0}, b = {0};
    int64_t c = 0;
    for (; c + 1 < chunks; c += 2) {
        const v8 x0 = *(const v8u *)(x + 8 * c), y0 = *(const v8u *)(y + 8 * c);
        const v8 x1 = *(const v8u *)(x + 8 * c + 8), y1 = *(const v8u *)(y + 8 * c + 8);
        a += x0 * y0;
        b += x1 * y1;
    }
    if (c < chunks) {
        a += *(const v8u *)(x + 8 * c) * *(const v8u *)(y + 8 * c);
    }
    a += b;
    return (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]);
}

/* acc += p * x over `chunks` * 8 floats. */
static inline __attribute__((always_inline)) void _axpy(float *acc, float p, const float *x, const int64_t chunks) {
    for (int64_t c = 0; c < chunks; c++) {
        *(v8u *)(acc + 8 * c) += p * *(const v8u *)(x + 8 * c);
    }
}

/* One work item: row r's query heads of KV heads [h0, h1). Pass 1 reads each context token's K for those
 * KV heads (one contiguous run of the token's row) and scores every query head of theirs; pass 2 reads V
 * the same way and weights it. `chunks` is a constant where it is inlined for 64 and 128-wide heads. */
static inline __attribute__((always_inline)) void
_item(const float *q, const float *k, const float *v, const int64_t *blocks, int64_t len, float *out,
      float *scores, float *acc, int64_t h0, int64_t h1, int64_t group, const int64_t chunks, int64_t kv_heads,
      int64_t block_size, int64_t longest, float scale) {
    const int64_t head_dim = 8 * chunks, token_stride = kv_heads * head_dim, first = h0 * group;
    const int64_t count = (h1 - h0) * group;
    for (int64_t t = 0; t < len; t++) {
        const float *kt = _token(k, blocks, t, block_size, token_stride);
        for (int64_t j = 0; j < count; j++)
            scores[j * longest + t] = _dot(q + (first + j) * head_dim, kt + (h0 + j / group) * head_dim, chunks);
    }
    for (int64_t j = 0; j < count; j++) {
        float *s = scores + j * longest, peak = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < len; t++)
            peak = s[t] * scale > peak ? s[t] * scale : peak;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] * scale - peak);
            total += s[t];
        }
        const float inverse = 1.0f / total;
        for (int64_t t = 0; t < len; t++)
            s[t] *= inverse;
    }
    memset(acc, 0, sizeof(float) * (size_t)(count * head_dim));
    for (int64_t t = 0; t < len; t++) {
        const float *vt = _token(v, blocks, t, block_size, token_stride);
        for (int64_t j = 0; j < count; j++)
            _axpy(acc + j * head_dim, scores[j * longest + t], vt + (h0 + j / group) * head_dim, chunks);
    }
    memcpy(out + first * head_dim, acc, sizeof(float) * (size_t)(count * head_dim));
}

int paged_decode_attention(const float *q, const float *k, const float *v, const int64_t *table,
                           const int64_t *lens, float *out, int64_t rows, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                           int threads) {
    const int64_t group = heads / kv_heads, chunks = head_dim / 8, longest = max_blocks * block_size;
    if (head_dim % 8 != 0 || heads % kv_heads != 0)
        return -2;
    /* A row is one item when there are rows enough to keep every thread busy (each token's K and V then
     * stream as one run); else each KV head of a row is one. */
    const int64_t split = rows >= 4 * threads ? 1 : kv_heads, span = kv_heads / split;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(span * group * (longest + head_dim)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *acc = scores + span * group * longest;
            for (int64_t item = omp_get_thread_num(); item < rows * split; item += omp_get_num_threads()) {
                const int64_t r = item / split, h0 = (item % split) * span;
                const float *qr = q + r * heads * head_dim;
                float *o = out + r * heads * head_dim;
                const int64_t *blocks = table + r * max_blocks;
                if (chunks == 8)
                    _item(qr, k, v, blocks, lens[r], o, scores, acc, h0, h0 + span, group, 8, kv_heads,
                          block_size, longest, scale);
                else if (chunks == 16)
                    _item(qr, k, v, blocks, lens[r], o, scores, acc, h0, h0 + span, group, 16, kv_heads,
                          block_size, longest, scale);
                else
                    _item(qr, k, v, blocks, lens[r], o, scores, acc, h0, h0 + span, group, chunks, kv_heads,
                          block_size, longest, scale);
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}
