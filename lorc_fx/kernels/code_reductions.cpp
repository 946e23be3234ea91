// Decode attention over quantized cache codes, its two reductions and a plain plan's whole
// step fused, for x86-64 CPUs with AVX2 (AVX-512 where the compiler targets it), registered as
// the ATen ops lorc::code_scores, lorc::code_sums and lorc::code_attention (their CPU kernels;
// lorc_fx/kernels/code_reductions.py builds this file once per machine against torch's headers
// and loads it, and gives the ops their shapes for tracing).
//
// Layouts (lorc_fx/codes/integer.py): codes are unsigned, 8 bits a byte or 4 bits two a byte
// (a run of `len` codes packed in len/2 bytes, byte j holding code j in its low nibble and code
// j + len/2 in its high one); a value is zero + code * scale, scale and zero per group.
//
// - code_scores(q, payload, scale, zero, bits): q (B, HK, M, W) against per-channel codes
//   (B, HK, W, groups, G*bits/8), scale and zero (B, HK, W, groups): out (B, HK, M, groups*G) =
//   sum_c q[m,c] * (zero[c,g] + code[c,g,j] * scale[c,g]) for token j of group g.
// - code_sums(p, payload, scale, zero, bits): weights p (B, HK, M, N) against per-token codes
//   (B, HK, N, CG, Gc*bits/8), scale and zero (B, HK, N, CG): out (B, HK, M, CG*Gc) =
//   sum_n p[m,n] * (zero[n,cg] + code[n,cg,j] * scale[n,cg]) for channel j of channel group cg.
// - code_attention(q, key codes, value codes, k_window, v_window, bias, scale): the two fused
//   with the softmax between them, for a plain plan's decode step: keys per channel over N slots
//   and values per token over the first NV of them (the slots past NV are masked), then R window
//   rows (B, HK, R, D); scores scaled and biased by bias (B, T, N + R) (0 or -inf, or an additive
//   mask; query row m of a kv head is query token m % T), softmax, weighted sum of the values:
//   out (B, HK, M, D). A row with nothing to attend gets zeros.
// Results are float32; scales, zero points, queries, weights and windows are read as float32.
//
// Why by hand: written as tensor maths, Inductor's C++ loops keep one accumulator per output
// vector and convert every code once per query row it meets; here a tile of 3 rows x NC vectors
// stays in registers while each code is widened to float once and used for all 3 rows. Both
// reductions are sums of products in float32, in another order than the tensor maths.
//
// Why ATen ops in C++ rather than Python ops calling this through ctypes: the dispatcher's call
// into a Python kernel, and the kernel's own Python, cost ~60 us a call in a decode step whose
// weights have just streamed through the caches (2 ms a step of the default model's 30 layers,
// bench/results/long_context_cache_choice-cpu.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
constexpr int64_t VW = 16;  // floats in a vector
typedef float vf __attribute__((vector_size(64)));
static inline __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
static inline vf widen(__m128i b) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
#elif defined(__AVX2__)
constexpr int64_t VW = 8;
typedef float vf __attribute__((vector_size(32)));
static inline __m128i load_bytes(const uint8_t* p) { return _mm_loadl_epi64((const __m128i*)p); }
static inline vf widen(__m128i b) { return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
#else
#error "lorc_fx's CPU code reductions need AVX2"
#endif

constexpr int64_t ROWS = 3;  // query rows of a register tile

static inline vf broadcast(float x) {
    vf v = {};
    return v + x;
}

static inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

// VW codes of a run of `len` codes, from code j0 on, as floats.
static inline vf chunk(const uint8_t* run, int64_t bits, int64_t len, int64_t j0) {
    if (bits == 8) return widen(load_bytes(run + j0));
    const int64_t half = len / 2;
    const __m128i low = _mm_set1_epi8(15);
    if (j0 < half) return widen(_mm_and_si128(load_bytes(run + j0), low));
    return widen(_mm_and_si128(_mm_srli_epi16(load_bytes(run + j0 - half), 4), low));
}

// One tile of scores: ROWS query rows of one group, tokens j0..j0+NC*VW. `qs` holds
// q[m,c]*scale[c,g] at [c*ROWS + m], `zs` sum_c q[m,c]*zero[c,g] at [m].
template <int64_t NC>
static void scores_tile(const float* qs, const float* zs, int64_t rows, const uint8_t* run0,
                        int64_t channel_stride, int64_t W, int64_t bits, int64_t G, int64_t j0,
                        float* out, int64_t out_stride) {
    vf acc[ROWS][NC];
    for (int64_t m = 0; m < ROWS; ++m)
        for (int64_t k = 0; k < NC; ++k) acc[m][k] = broadcast(zs[m]);
    for (int64_t c = 0; c < W; ++c) {
        // this channel's run of the next group: the runs of a group lie a channel apart, each
        // in its own page, past what the hardware prefetcher follows
        __builtin_prefetch(run0 + c * channel_stride + (G + j0) * bits / 8);
        vf codes[NC];
        for (int64_t k = 0; k < NC; ++k)
            codes[k] = chunk(run0 + c * channel_stride, bits, G, j0 + k * VW);
        for (int64_t m = 0; m < ROWS; ++m) {
            const vf sv = broadcast(qs[c * ROWS + m]);
            for (int64_t k = 0; k < NC; ++k) acc[m][k] += sv * codes[k];
        }
    }
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t k = 0; k < NC; ++k) store(out + m * out_stride + j0 + k * VW, acc[m][k]);
}

// Scores of `rows` (<= ROWS) query rows q (rows, W) against one group of per-channel codes:
// channel c's run at run0 + c * channel_stride, its scale and zero point at
// scale[c * scale_stride]; out[m * out_stride + j] for the group's G tokens. `qs`: (W + 1) *
// ROWS floats of work.
static void group_scores(const float* q, int64_t rows, const float* scale, const float* zero,
                         int64_t scale_stride, const uint8_t* run0, int64_t channel_stride,
                         int64_t W, int64_t bits, int64_t G, float* qs, float* out,
                         int64_t out_stride) {
    float* zs = qs + W * ROWS;
    for (int64_t m = 0; m < ROWS; ++m) {
        float z = 0.f;
        for (int64_t c = 0; c < W; ++c) {
            const float qv = m < rows ? q[m * W + c] : 0.f;
            qs[c * ROWS + m] = qv * scale[c * scale_stride];
            z += qv * zero[c * scale_stride];
        }
        zs[m] = z;
    }
    for (int64_t j0 = 0; j0 < G;) {
        if (G - j0 >= 4 * VW) {
            scores_tile<4>(qs, zs, rows, run0, channel_stride, W, bits, G, j0, out, out_stride);
            j0 += 4 * VW;
        } else {
            scores_tile<2>(qs, zs, rows, run0, channel_stride, W, bits, G, j0, out, out_stride);
            j0 += 2 * VW;
        }
    }
}

// One tile of value sums: weights p[m][n] of ROWS rows (those past `rows` all zeros) over N
// tokens of per-token codes, channels j0..j0+NC*VW of one channel group.
template <int64_t NC>
static void sums_tile(const float* const* p, int64_t rows, const uint8_t* run0,
                      int64_t token_stride, const float* scale, const float* zero,
                      int64_t scale_stride, int64_t N, int64_t bits, int64_t Gc, int64_t j0,
                      float* out, int64_t out_stride) {
    vf acc[ROWS][NC];
    float by_zero[ROWS] = {};
    for (int64_t m = 0; m < ROWS; ++m)
        for (int64_t k = 0; k < NC; ++k) acc[m][k] = broadcast(0.f);
    for (int64_t n = 0; n < N; ++n) {
        // with the hardware prefetcher alone the op took 8% longer over a layer's cold codes
        if (j0 == 0) __builtin_prefetch(run0 + (n + 32) * token_stride);
        vf codes[NC];
        for (int64_t k = 0; k < NC; ++k)
            codes[k] = chunk(run0 + n * token_stride, bits, Gc, j0 + k * VW);
        const float s = scale[n * scale_stride], z = zero[n * scale_stride];
        for (int64_t m = 0; m < ROWS; ++m) {
            const float pm = p[m][n];
            by_zero[m] += pm * z;
            const vf ps = broadcast(pm * s);
            for (int64_t k = 0; k < NC; ++k) acc[m][k] += ps * codes[k];
        }
    }
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t k = 0; k < NC; ++k)
            store(out + m * out_stride + j0 + k * VW, acc[m][k] + by_zero[m]);
}

// Sums of `rows` (<= ROWS) weight rows p[m] (N) over per-token codes (N, CG, Gc*bits/8) with
// scales and zero points (N, CG): out[m * out_stride + cg * Gc + j].
static void token_sums(const float* const* p, int64_t rows, const uint8_t* payload,
                       const float* scale, const float* zero, int64_t N, int64_t CG, int64_t Gc,
                       int64_t bits, float* out, int64_t out_stride) {
    const int64_t run_bytes = Gc * bits / 8;
    for (int64_t cg = 0; cg < CG; ++cg) {
        const uint8_t* run0 = payload + cg * run_bytes;
        for (int64_t j0 = 0; j0 < Gc;) {
            if (Gc - j0 >= 4 * VW) {
                sums_tile<4>(p, rows, run0, CG * run_bytes, scale + cg, zero + cg, CG, N, bits,
                             Gc, j0, out + cg * Gc, out_stride);
                j0 += 4 * VW;
            } else {
                sums_tile<2>(p, rows, run0, CG * run_bytes, scale + cg, zero + cg, CG, N, bits,
                             Gc, j0, out + cg * Gc, out_stride);
                j0 += 2 * VW;
            }
        }
    }
}

static inline int64_t tiles_of(int64_t M) { return (M + ROWS - 1) / ROWS; }

static inline float* thread_work(float* work, int64_t per_thread) {
#ifdef _OPENMP
    return work + omp_get_thread_num() * per_thread;
#else
    return work;
#endif
}

// work: threads * (W + 1) * ROWS floats.
static void scores_kernel(const float* q, const uint8_t* payload, const float* scale,
                                 const float* zero, float* out, float* work, int64_t BH,
                                 int64_t M, int64_t W, int64_t groups, int64_t G, int64_t bits,
                                 int threads) {
    const int64_t run_bytes = G * bits / 8, tiles = tiles_of(M);
#pragma omp parallel for collapse(3) num_threads(threads)
    for (int64_t bh = 0; bh < BH; ++bh) {
        for (int64_t g = 0; g < groups; ++g) {
            for (int64_t tile = 0; tile < tiles; ++tile) {
                const int64_t m0 = tile * ROWS, rows = M - m0 < ROWS ? M - m0 : ROWS;
                group_scores(q + (bh * M + m0) * W, rows, scale + bh * W * groups + g,
                             zero + bh * W * groups + g, groups,
                             payload + (bh * W * groups + g) * run_bytes, groups * run_bytes, W,
                             bits, G, thread_work(work, (W + 1) * ROWS),
                             out + (bh * M + m0) * groups * G + g * G, groups * G);
            }
        }
    }
}

// zeros: N floats of 0 (the weights of the rows past M in the last tile).
static void sums_kernel(const float* p, const uint8_t* payload, const float* scale,
                               const float* zero, float* out, float* zeros, int64_t BH, int64_t M,
                               int64_t N, int64_t CG, int64_t Gc, int64_t bits, int threads) {
    const int64_t run_bytes = Gc * bits / 8, tiles = tiles_of(M);
#pragma omp parallel for collapse(2) num_threads(threads)
    for (int64_t bh = 0; bh < BH; ++bh) {
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t m0 = tile * ROWS, rows = M - m0 < ROWS ? M - m0 : ROWS;
            const float* weights[ROWS];
            for (int64_t m = 0; m < ROWS; ++m)
                weights[m] = m < rows ? p + (bh * M + m0 + m) * N : zeros;
            token_sums(weights, rows, payload + bh * N * CG * run_bytes, scale + bh * N * CG,
                       zero + bh * N * CG, N, CG, Gc, bits, out + (bh * M + m0) * CG * Gc,
                       CG * Gc);
        }
    }
}

// exp(x) for x <= 0 (softmax arguments), float32 to about 2 ulp: x = n*ln2 + r, |r| <= ln2/2,
// exp(r) by its degree-6 Taylor-minimax polynomial, 2^n through the exponent bits. Below
// -87.3 (where 2^n leaves the normal floats) and for -inf it is 0.
static inline vf exp_nonpositive(vf x) {
    typedef int32_t vi __attribute__((vector_size(sizeof(vf))));
    const float shifter = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
    const vf n = (x * 1.44269504088896341f + shifter) - shifter;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = broadcast(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    vi bits = __builtin_convertvector(n, vi) + 127;
    bits = bits << 23;
    vf scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return x < -87.3f ? broadcast(0.f) : p * scale;
}

// work: threads * ROWS * (N + R + D + 1 + VCG * Gv) floats.
static void attention_kernel(
        const float* q, const uint8_t* k_payload, const float* k_scale, const float* k_zero,
        const uint8_t* v_payload, const float* v_scale, const float* v_zero,
        const float* k_window, const float* v_window, const float* bias, float* out, float* work,
        int64_t B, int64_t HK, int64_t M, int64_t T, int64_t D, int64_t groups, int64_t G,
        int64_t k_bits, int64_t NV, int64_t VCG, int64_t Gv, int64_t v_bits, int64_t R,
        float softmax_scale, int threads) {
    const int64_t N = groups * G, P = N + R, k_run = G * k_bits / 8, v_run = Gv * v_bits / 8;
    const int64_t tiles = tiles_of(M), v_width = VCG * Gv;
#pragma omp parallel for collapse(2) num_threads(threads)
    for (int64_t bh = 0; bh < B * HK; ++bh) {
        for (int64_t tile = 0; tile < tiles; ++tile) {
            float* probs = thread_work(work, ROWS * (P + D + 1 + v_width));  // (ROWS, P)
            float* qs = probs + ROWS * P;                                    // (D + 1, ROWS)
            float* values = qs + (D + 1) * ROWS;                             // (ROWS, v_width)
            const int64_t m0 = tile * ROWS, rows = M - m0 < ROWS ? M - m0 : ROWS;
            const float* qb = q + (bh * M + m0) * D;
            for (int64_t g = 0; g < groups; ++g)  // scores of the code slots
                group_scores(qb, rows, k_scale + bh * D * groups + g, k_zero + bh * D * groups + g,
                             groups, k_payload + (bh * D * groups + g) * k_run, groups * k_run, D,
                             k_bits, G, qs, probs + g * G, P);
            for (int64_t r = 0; r < R; ++r) {  // scores of the window rows
                const float* kr = k_window + (bh * R + r) * D;
                for (int64_t m = 0; m < rows; ++m) {
                    float dot = 0.f;
                    for (int64_t c = 0; c < D; ++c) dot += qb[m * D + c] * kr[c];
                    probs[m * P + N + r] = dot;
                }
            }
            // softmax of each row, left unnormalised (sums[m] divides at the end); rows past
            // the tile's weigh nothing
            float sums[ROWS] = {};
            for (int64_t m = rows; m < ROWS; ++m)
                for (int64_t n = 0; n < P; ++n) probs[m * P + n] = 0.f;
            const int64_t b = bh / HK;
            for (int64_t m = 0; m < rows; ++m) {
                float* row = probs + m * P;
                const float* bias_row = bias + (b * T + (m0 + m) % T) * P;
                float top = -__builtin_inff();
                for (int64_t n = 0; n < P; ++n) {
                    row[n] = row[n] * softmax_scale + bias_row[n];
                    top = row[n] > top ? row[n] : top;
                }
                if (top == -__builtin_inff()) {  // nothing to attend: zeros
                    for (int64_t n = 0; n < P; ++n) row[n] = 0.f;
                    continue;
                }
                vf total = broadcast(0.f);
                int64_t n = 0;
                for (; n + VW <= P; n += VW) {
                    vf x;
                    __builtin_memcpy(&x, row + n, sizeof x);
                    x = exp_nonpositive(x - top);
                    store(row + n, x);
                    total += x;
                }
                float sum = 0.f;
                for (int64_t k = 0; k < VW; ++k) sum += total[k];
                for (; n < P; ++n) {
                    row[n] = exp_nonpositive(broadcast(row[n] - top))[0];
                    sum += row[n];
                }
                sums[m] = sum;
            }
            // the values: code slots (the first NV), then the window rows
            const float* weights[ROWS];
            for (int64_t m = 0; m < ROWS; ++m) weights[m] = probs + m * P;
            token_sums(weights, rows, v_payload + bh * NV * VCG * v_run, v_scale + bh * NV * VCG,
                       v_zero + bh * NV * VCG, NV, VCG, Gv, v_bits, values, v_width);
            for (int64_t m = 0; m < rows; ++m) {
                float* o = out + (bh * M + m0 + m) * D;
                const float inv = sums[m] > 0.f ? 1.f / sums[m] : 0.f;
                for (int64_t c = 0; c < D; ++c) {
                    float acc = values[m * v_width + c];
                    for (int64_t r = 0; r < R; ++r)
                        acc += probs[m * P + N + r] * v_window[(bh * R + r) * D + c];
                    o[c] = acc * inv;
                }
            }
        }
    }
}

// ---------------------------------------------------------------- the ops' CPU kernels

namespace {

at::Tensor floats(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// One side's codes as the kernels read them: the payload contiguous, scales and zero points
// float32, and the codes a group holds (a run of the payload's last axis), checked.
struct Codes {
    at::Tensor payload, scale, zero;
    int64_t group;
};

Codes codes_of(const at::Tensor& payload, const at::Tensor& scale, const at::Tensor& zero,
               int64_t bits, const char* op) {
    TORCH_CHECK(payload.device().is_cpu() && payload.scalar_type() == at::kByte,
                "lorc::", op, ": codes must be a uint8 CPU tensor");
    TORCH_CHECK(bits == 8 || bits == 4, "lorc::", op, ": codes of 8 or 4 bits, not ", bits);
    const int64_t group = payload.size(-1) * 8 / bits;
    TORCH_CHECK(group % 32 == 0, "lorc::", op,  // whole vectors of codes, for 4 bits in each half
                ": groups of a multiple of 32 codes, not ", group);
    return {payload.contiguous(), floats(scale), floats(zero), group};
}

at::Tensor code_scores(const at::Tensor& q_in, const at::Tensor& payload,
                       const at::Tensor& scale, const at::Tensor& zero, int64_t bits) {
    const Codes keys = codes_of(payload, scale, zero, bits, "code_scores");
    const at::Tensor q = floats(q_in);
    const int64_t B = q.size(0), HK = q.size(1), M = q.size(2), W = q.size(3);
    const int64_t groups = keys.payload.size(3);
    at::Tensor out = at::empty({B, HK, M, groups * keys.group}, q.options());
    const int threads = at::get_num_threads();
    at::Tensor work = at::empty({threads * (W + 1) * ROWS}, q.options());
    scores_kernel(q.data_ptr<float>(), keys.payload.data_ptr<uint8_t>(),
                  keys.scale.data_ptr<float>(), keys.zero.data_ptr<float>(),
                  out.data_ptr<float>(), work.data_ptr<float>(), B * HK, M, W, groups,
                  keys.group, bits, threads);
    return out;
}

at::Tensor code_sums(const at::Tensor& p_in, const at::Tensor& payload,
                     const at::Tensor& scale, const at::Tensor& zero, int64_t bits) {
    const Codes values = codes_of(payload, scale, zero, bits, "code_sums");
    const at::Tensor p = floats(p_in);
    const int64_t B = p.size(0), HK = p.size(1), M = p.size(2), N = p.size(3);
    const int64_t channel_groups = values.payload.size(3);
    at::Tensor out = at::empty({B, HK, M, channel_groups * values.group}, p.options());
    at::Tensor zeros = at::zeros({N}, p.options());  // the weights of rows past M in a tile
    sums_kernel(p.data_ptr<float>(), values.payload.data_ptr<uint8_t>(),
                values.scale.data_ptr<float>(), values.zero.data_ptr<float>(),
                out.data_ptr<float>(), zeros.data_ptr<float>(), B * HK, M, N, channel_groups,
                values.group, bits, at::get_num_threads());
    return out;
}

at::Tensor code_attention(const at::Tensor& q_in, const at::Tensor& k_payload,
                          const at::Tensor& k_scale, const at::Tensor& k_zero, int64_t k_bits,
                          const at::Tensor& v_payload, const at::Tensor& v_scale,
                          const at::Tensor& v_zero, int64_t v_bits,
                          const at::Tensor& k_window_in, const at::Tensor& v_window_in,
                          const at::Tensor& bias_in, double softmax_scale) {
    const Codes keys = codes_of(k_payload, k_scale, k_zero, k_bits, "code_attention");
    const Codes values = codes_of(v_payload, v_scale, v_zero, v_bits, "code_attention");
    const at::Tensor q = floats(q_in), bias = floats(bias_in);
    const at::Tensor k_window = floats(k_window_in), v_window = floats(v_window_in);
    const int64_t B = q.size(0), HK = q.size(1), M = q.size(2), D = q.size(3);
    const int64_t groups = keys.payload.size(3), channel_groups = values.payload.size(3);
    const int64_t T = bias.size(1), R = k_window.size(2), NV = values.payload.size(2);
    at::Tensor out = at::empty({B, HK, M, D}, q.options());
    const int threads = at::get_num_threads();
    at::Tensor work = at::empty(
        {threads * ROWS * (groups * keys.group + R + D + 1 + channel_groups * values.group)},
        q.options());
    attention_kernel(q.data_ptr<float>(), keys.payload.data_ptr<uint8_t>(),
                     keys.scale.data_ptr<float>(), keys.zero.data_ptr<float>(),
                     values.payload.data_ptr<uint8_t>(), values.scale.data_ptr<float>(),
                     values.zero.data_ptr<float>(), k_window.data_ptr<float>(),
                     v_window.data_ptr<float>(), bias.data_ptr<float>(), out.data_ptr<float>(),
                     work.data_ptr<float>(), B, HK, M, T, D, groups, keys.group, k_bits, NV,
                     channel_groups, values.group, v_bits, R,
                     static_cast<float>(softmax_scale), threads);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorc, m) {
    m.def("code_scores(Tensor q, Tensor payload, Tensor scale, Tensor zero, int bits) -> Tensor");
    m.def("code_sums(Tensor p, Tensor payload, Tensor scale, Tensor zero, int bits) -> Tensor");
    m.def("code_attention(Tensor q, Tensor k_payload, Tensor k_scale, Tensor k_zero, int k_bits, "
          "Tensor v_payload, Tensor v_scale, Tensor v_zero, int v_bits, Tensor k_window, "
          "Tensor v_window, Tensor bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lorc, CPU, m) {
    m.impl("code_scores", code_scores);
    m.impl("code_sums", code_sums);
    m.impl("code_attention", code_attention);
}
