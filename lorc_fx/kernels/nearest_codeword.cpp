// The nearest codeword of each sample, for fitting and coding product vector codes on x86-64
// CPUs with AVX2 (AVX-512 where the compiler targets it): lorc_fx/kernels/nearest_codeword.py
// builds this file once per machine (kernels/native.py) and calls it through ctypes.
//
// - lorc_nearest: samples transposed, xt (S, D, N), against codewords times -2, c2 (S, K, D),
//   with their squared norms (S, K): out (S, N), for each sample i of set s the k of the least
//   norms[s,k] + sum_e c2[s,k,e] * xt[s,e,i] (the nearest codeword; the first of equals).
//   D is 1, 2, 4, 8 or 16.
//
// Why by hand: as tensor maths (a batched product, then argmin) the (S, N, K) distances go
// through memory, and with D of 1 to 16 the product is a few multiply-adds per element written:
// k-means over the default model's calibration latents spent ~3 s a codebook there. Here a
// vector of VW samples stays in registers, dimension by dimension, while every codeword is
// compared with all of them; the least distance and its codeword of each lane ride beside.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
constexpr int64_t VW = 16;  // floats in a vector
#elif defined(__AVX2__)
constexpr int64_t VW = 8;
#else
#error "lorc_fx's nearest-codeword kernel needs AVX2"
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

// Samples i0 .. i0 + count (count <= VW) of one set.
template <int64_t D>
static void nearest_block(const float* xt, int64_t N, int64_t i0, int64_t count,
                          const float* c2, const float* norms, int64_t K, int64_t* out) {
    vf x[D];
    for (int64_t e = 0; e < D; ++e) {
        float lanes[VW] = {};
        std::memcpy(lanes, xt + e * N + i0, count * sizeof(float));
        std::memcpy(&x[e], lanes, sizeof(vf));
    }
    vf best = vf{} + std::numeric_limits<float>::infinity();
    vi where = vi{};
    for (int64_t k = 0; k < K; ++k) {
        vf dist = vf{} + norms[k];
        for (int64_t e = 0; e < D; ++e) dist += c2[k * D + e] * x[e];
        const vi nearer = dist < best;  // strict: an earlier codeword keeps a tie
        best = nearer ? dist : best;
        where = nearer ? vi{} + (int32_t)k : where;
    }
    for (int64_t l = 0; l < count; ++l) out[i0 + l] = where[l];
}

template <int64_t D>
static void nearest_all(const float* xt, const float* c2, const float* norms, int64_t* out,
                        int64_t S, int64_t N, int64_t K, int threads) {
    const int64_t blocks = (N + VW - 1) / VW;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t s = 0; s < S; ++s)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t i0 = b * VW, count = N - i0 < VW ? N - i0 : VW;
            nearest_block<D>(xt + s * D * N, N, i0, count, c2 + s * K * D, norms + s * K, K,
                             out + s * N);
        }
}

// 0 when done; -1 for a D the kernel does not take.
extern "C" int lorc_nearest(const float* xt, const float* c2, const float* norms, int64_t* out,
                            int64_t S, int64_t N, int64_t D, int64_t K, int threads) {
    switch (D) {
        case 1: nearest_all<1>(xt, c2, norms, out, S, N, K, threads); return 0;
        case 2: nearest_all<2>(xt, c2, norms, out, S, N, K, threads); return 0;
        case 4: nearest_all<4>(xt, c2, norms, out, S, N, K, threads); return 0;
        case 8: nearest_all<8>(xt, c2, norms, out, S, N, K, threads); return 0;
        case 16: nearest_all<16>(xt, c2, norms, out, S, N, K, threads); return 0;
        default: return -1;
    }
}
