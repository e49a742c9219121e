/* Two of a Llama layer's small steps, each in one call where torch takes four to eight operations
 * (backends/kernels/fused_ops.py loads this; backends/models/llama.py calls it on a CPU in float32). At a
 * decode step's few rows, each torch operation costs more in its dispatch than in its arithmetic.
 *
 *   add_rms_norm: hidden += delta (when delta is given), then out = hidden * rsqrt(mean(hidden^2) + eps)
 *                 * weight, row by row: the residual add and the next RMSNorm.
 *   rope_store:   from one token's fused q|k|v row, q rotated (rotate-half RoPE) into q_out, k rotated and v
 *                 copied into the KV cache at the token's slot.
 *
 * All float32 and contiguous. Rows go to `threads` OpenMP threads only when there are enough of them to
 * pay for it (a prefill chunk); the caller's OpenMP runtime (torch's) runs them. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_FROM 32768 /* elements: below, one thread (as torch's own grain size) */

void add_rms_norm(float *hidden, const float *delta, const float *weight, float *out, int64_t rows,
                  int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * dim;
        if (delta != NULL) {
            const float *d = delta + r * dim;
            for (int64_t i = 0; i < dim; i++)
                h[i] += d[i];
        }
        double squares = 0.0; /* NOTE: in double: the mean of a few thousand squares loses nothing */
        for (int64_t i = 0; i < dim; i++)
            squares += (double)h[i] * h[i];
        const float scale = (float)(1.0 / sqrt(squares / (double)dim + (double)eps));
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++)
            o[i] = (h[i] * scale) * weight[i];
    }
}

/* y = x * cos + rotate_half(x) * sin over one head of `dim` (even) floats. */
static inline void _rotate(const float *x, const float *c, const float *s, float *y, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < half; t++)
        y[t] = x[t] * c[t] - x[t + half] * s[t];
    for (int64_t t = half; t < dim; t++)
        y[t] = x[t] * c[t] + x[t - half] * s[t];
}

/* qkv [rows, (heads + 2 * kv_heads) * head_dim]; cos, sin [max_positions, head_dim]; positions, slots [rows];
 * q_out [rows, heads, head_dim]; k_cache, v_cache [num_slots, kv_heads, head_dim]. Returns -1, writing
 * nothing of the offending row, where a position or a slot is out of its table. */
int rope_store(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
               const int64_t *slots, float *q_out, float *k_cache, float *v_cache, int64_t rows, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t max_positions, int64_t num_slots, int threads) {
    const int64_t stride = (heads + 2 * kv_heads) * head_dim, kv_row = kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel for num_threads(threads) if (rows * stride >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = positions[r], slot = slots[r];
        if (p < 0 || p >= max_positions || slot < 0 || slot >= num_slots) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *x = qkv + r * stride, *c = cos + p * head_dim, *s = sin + p * head_dim;
        for (int64_t j = 0; j < heads; j++)
            _rotate(x + j * head_dim, c, s, q_out + (r * heads + j) * head_dim, head_dim);
        for (int64_t j = 0; j < kv_heads; j++)
            _rotate(x + (heads + j) * head_dim, c, s, k_cache + slot * kv_row + j * head_dim, head_dim);
        memcpy(v_cache + slot * kv_row, x + (heads + kv_heads) * head_dim, sizeof(float) * (size_t)kv_row);
    }
    return failed ? -1 : 0;
}
