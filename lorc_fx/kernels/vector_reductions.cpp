// Decode attention's two reductions over product vector codes, reading the codes and small
// tables, never a decoded latent: lorc_fx/kernels/vector_reductions.py builds this file once per
// machine and calls it through ctypes.
//
// Layouts (lorc_fx/codes/vector.py): a side's latent (R channels) is cut in runs; run u holds
// S_u sub-vectors of d_u channels, each with a table of K_u = 2^ib_u reconstructions (S_u, K_u,
// d_u); a token stores one ib_u-bit index per sub-vector. Indices are packed per sub-vector in
// blocks of 8 tokens, ib_u bytes a block (lorc_fx/codes/integer.py pack_bits): payload_u is
// (B, S_u, blocks * ib_u) uint8, and slot j of a row is token j of its blocks. Every run's
// codewords together are the E = sum_u S_u * K_u *entries* of one table.
//
// - lorc_vector_scores: q (B, M, R) against every slot: out (B, M, blocks * 8). First each
//   entry's dot products with the M query rows, table_q (E, M padded to lines of 16 floats,
//   one 64-byte line an entry for M <= 16; M * sum_u S_u K_u d_u multiply-adds a step); then a
//   slot's M scores are the sum of its sub-vectors' entries' lines: one lookup a sub-vector,
//   instead of R multiply-adds a row over a decoded latent.
// - lorc_vector_sums: weights p (B, M, blocks * 8) over every slot: out (B, M, R) = sum_j
//   p[., j] * latent_j. Each block's 8 latents are decoded into L1 (decode_block) and added in,
//   weighted, to the M rows of out: the latent is never written to memory.
//
// Every kernel walks the codes a block at a time and, within it, run by run and sub-vector by
// sub-vector: each sub-vector's 8 indices are unpacked into registers and used at once (the
// 8 slots' lookups, or their codewords copied), the loop compiled for the run's index width.
// Scores sum in float32 in another order than decoding and multiplying; sums decode and
// multiply, a block at a time. Slots are split in `threads` chunks (sums: each into its own
// rows, work: B * chunks * M * R floats, added up at the end). Measured on the 2-core x86-64
// (Zen 5) machine, one thread, 4096 slots, M = 9, every layer of a 2.56-bit plan, this file
// against its version of d0dc2f1 (which unpacked a block's indices into a table of entries
// first), both in one process (bench/vector_reductions.py --against; run 11 of
// bench/results/long_context_vector-cpu.md): the keys' scores 8.6 ms against 11.7, the values'
// sums 10.2 against 15.0, the keys' decode 8.1 against 11.7; SDPA over the same layers' full
// float32 cache took ~17 (bench/results/vector_reductions-cpu.md).
//
// - lorc_vector_turned_scores: keys cached before RoPE in a RoPE-commuting basis, each latent
//   channel on one rotary pair (lorc_fx/compile/latent_attention.py per_frequency_scores): a
//   block's 8 latents decoded into L1, each channel times its pair's cos and sin at the slot's
//   position, and the two halves dotted with each query row's (alpha, beta): no key rebuilt,
//   no latent written to memory.
//
// lorc_vector_rewrite, at the end, is a static store's write (lorc::vector_rewritten), and
// lorc_vector_decode, last, a side's latents decoded (lorc::vector_decode on CPUs).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

constexpr int64_t BLOCK = 8;  // tokens whose indices pack together

// The 8 indices of one block of one sub-vector, packed in IB bytes at p.
template <int IB>
static inline void unpack_block(const uint8_t* p, int32_t* idx) {
    if constexpr (IB == 8) {
        for (int i = 0; i < BLOCK; ++i) idx[i] = p[i];
    } else if constexpr (IB == 4) {  // byte j: code j low, code 4 + j high
        for (int j = 0; j < 4; ++j) {
            idx[j] = p[j] & 15;
            idx[4 + j] = p[j] >> 4;
        }
    } else if constexpr (IB == 2) {  // byte j: codes j, 2 + j, 4 + j, 6 + j from the low bits
        for (int j = 0; j < 2; ++j)
            for (int i = 0; i < 4; ++i) idx[2 * i + j] = (p[j] >> (2 * i)) & 3;
    } else {  // 8 codes as one little-endian integer of 8 * IB bits
        uint64_t word = 0;
        for (int j = 0; j < IB; ++j) word |= uint64_t(p[j]) << (8 * j);
        for (int i = 0; i < BLOCK; ++i) idx[i] = int32_t((word >> (IB * i)) & ((1u << IB) - 1));
    }
}

// f(std::integral_constant<int, IB>) for the index bits ib (1..8): the kernels' loops over a
// run's blocks are compiled once per index width.
template <class F>
static inline void by_index_bits(int64_t ib, F&& f) {
    switch (ib) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{});
    }
}

struct Layout {
    const uint8_t* const* payloads;
    const float* const* tables;
    const int64_t *subs, *dims, *ibits;
    int64_t runs, R, blocks;
    std::vector<int64_t> first, table_at;  // per run: its first channel, its first table entry
    int64_t entries = 0;                   // sum_u S_u * K_u

    Layout(const uint8_t* const* p, const float* const* t, const int64_t* s, const int64_t* d,
           const int64_t* ib, int64_t runs_, int64_t R_, int64_t blocks_)
        : payloads(p), tables(t), subs(s), dims(d), ibits(ib), runs(runs_), R(R_),
          blocks(blocks_) {
        int64_t channel = 0;
        for (int64_t u = 0; u < runs; ++u) {
            first.push_back(channel);
            table_at.push_back(entries);
            channel += subs[u] * dims[u];
            entries += subs[u] * (int64_t(1) << ibits[u]);
        }
    }

    // Run u's packed indices of row b, block k: S_u runs of ib_u bytes, stride() apart.
    const uint8_t* block(int64_t u, int64_t b, int64_t k) const {
        return payloads[u] + b * subs[u] * stride(u) + k * ibits[u];
    }
    int64_t stride(int64_t u) const { return blocks * ibits[u]; }
};

// use(s, idx) for each of a run's S sub-vectors in one block, idx its 8 slots' indices
// (unpacked from IB bytes, `stride` apart from `row`).
template <int IB, class F>
static inline void each_sub(const uint8_t* row, int64_t S, int64_t stride, F&& use) {
    int32_t idx[BLOCK];
    for (int64_t s = 0; s < S; ++s) {
        unpack_block<IB>(row + s * stride, idx);
        use(s, idx);
    }
}

// A run's sub-vectors of D channels in one block: the 8 slots' codewords copied into lat (8
// rows of R floats, from the run's first channel).
template <int IB, int D>
static inline void run_decode(const uint8_t* row, int64_t S, int64_t stride, const float* table,
                              int64_t R, float* lat) {
    each_sub<IB>(row, S, stride, [&](int64_t s, const int32_t* idx) {
        const float* words = table + (s << IB) * D;
        for (int i = 0; i < BLOCK; ++i)
            std::memcpy(lat + i * R + s * D, words + int64_t(idx[i]) * D, D * sizeof(float));
    });
}

template <int IB>
static inline void run_decode(int64_t D, const uint8_t* row, int64_t S, int64_t stride,
                              const float* table, int64_t R, float* lat) {
    switch (D) {  // the callers check that every run's d is one of these five
        case 1: run_decode<IB, 1>(row, S, stride, table, R, lat); break;
        case 2: run_decode<IB, 2>(row, S, stride, table, R, lat); break;
        case 4: run_decode<IB, 4>(row, S, stride, table, R, lat); break;
        case 8: run_decode<IB, 8>(row, S, stride, table, R, lat); break;
        default: run_decode<IB, 16>(row, S, stride, table, R, lat);
    }
}

// The 8 latents of row b's block k, each R floats of lat, `pitch` floats apart (R unless
// given).
static void decode_block(const Layout& L, int64_t b, int64_t k, float* lat, int64_t pitch = 0) {
    pitch = pitch ? pitch : L.R;
    for (int64_t u = 0; u < L.runs; ++u) {
        const uint8_t* row = L.block(u, b, k);
        const int64_t S = L.subs[u], stride = L.stride(u), d = L.dims[u];
        const float* table = L.tables[u];
        float* at = lat + L.first[u];
        by_index_bits(L.ibits[u],
                      [&](auto IB) { run_decode<IB>(d, row, S, stride, table, pitch, at); });
    }
}

static inline int64_t chunk_start(int64_t blocks, int64_t chunks, int64_t c) {
    return blocks * c / chunks;
}

// A table entry's dot products with the query rows, LINE floats (one 64-byte line), zero past
// the last row: a lookup adds one line, whole. Also the turned scores' unit of work.
constexpr int64_t LINE = 16;
#ifdef __AVX512F__
struct Line {
    __m512 v;
    static Line zero() { return {_mm512_setzero_ps()}; }
    static Line load(const float* e) { return {_mm512_loadu_ps(e)}; }
    void add(const float* e) { v = _mm512_add_ps(v, _mm512_loadu_ps(e)); }
    void fma(const Line& a, const Line& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
    void store(float* to) const { _mm512_store_ps(to, v); }
    float sum() const { return _mm512_reduce_add_ps(v); }
};
#else
struct Line {
    __m256 lo, hi;
    static Line zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Line load(const float* e) { return {_mm256_loadu_ps(e), _mm256_loadu_ps(e + 8)}; }
    void add(const float* e) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(e));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(e + 8));
    }
    void fma(const Line& a, const Line& b) {
        lo = _mm256_fmadd_ps(a.lo, b.lo, lo);
        hi = _mm256_fmadd_ps(a.hi, b.hi, hi);
    }
    void store(float* to) const {
        _mm256_store_ps(to, lo);
        _mm256_store_ps(to + 8, hi);
    }
    float sum() const {
        const __m256 s = _mm256_add_ps(lo, hi);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
    }
};
#endif

// A run's lookups in one block: each sub-vector's table lines added to the 8 slots' sums. t:
// the run's first line.
template <int IB>
static inline void run_lookups(const uint8_t* row, int64_t S, int64_t stride, const float* t,
                               int64_t pitch, Line* acc) {
    each_sub<IB>(row, S, stride, [&](int64_t s, const int32_t* idx) {
        const float* sub = t + (s << IB) * pitch;
        for (int i = 0; i < BLOCK; ++i) acc[i].add(sub + int64_t(idx[i]) * pitch);
    });
}

// Scores of row b's blocks k0..k1 for the query rows of line `line` of table_q (E, pitch):
// the 8 slots of a block at once (8 independent sums in flight). out (M, slots).
static void scores_by_table(const Layout& L, const float* tq, int64_t pitch, int64_t line,
                            int64_t rows, int64_t b, int64_t k0, int64_t k1, float* out) {
    const int64_t slots = L.blocks * BLOCK, r0 = line * LINE;
    alignas(64) float tile[BLOCK][LINE];
    for (int64_t k = k0; k < k1; ++k) {
        Line acc[BLOCK];
        for (int i = 0; i < BLOCK; ++i) acc[i] = Line::zero();
        for (int64_t u = 0; u < L.runs; ++u) {
            const uint8_t* row = L.block(u, b, k);
            const int64_t S = L.subs[u], stride = L.stride(u);
            const float* t = tq + L.table_at[u] * pitch + r0;
            by_index_bits(L.ibits[u],
                          [&](auto IB) { run_lookups<IB>(row, S, stride, t, pitch, acc); });
        }
        for (int i = 0; i < BLOCK; ++i) acc[i].store(tile[i]);
        for (int64_t m = 0; m < rows; ++m)
            for (int64_t i = 0; i < BLOCK; ++i) out[(r0 + m) * slots + k * BLOCK + i] = tile[i][m];
    }
}

// Floats of lorc_vector_scores' work: the table of B rows' E entries, a line of M rows each.
extern "C" int64_t lorc_vector_scores_work(int64_t B, int64_t M, int64_t E) {
    return B * E * ((M + LINE - 1) / LINE * LINE);
}

extern "C" void lorc_vector_scores(const float* q, const uint8_t* const* payloads,
                                   const float* const* tables, const int64_t* subs,
                                   const int64_t* dims, const int64_t* ibits, int64_t runs,
                                   int64_t B, int64_t M, int64_t R, int64_t blocks, float* out,
                                   float* work, int threads) {
    const Layout L(payloads, tables, subs, dims, ibits, runs, R, blocks);
    const int64_t E = L.entries, chunks = threads, MP = (M + LINE - 1) / LINE * LINE;
    // work (B, E, MP): every entry's dot products with the query rows, LINE floats a line
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        std::vector<float> qt(R * MP, 0.f);  // the query rows transposed, (R, MP)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t c = 0; c < R; ++c) qt[c * MP + m] = q[(b * M + m) * R + c];
        for (int64_t u = 0; u < runs; ++u) {
            const int64_t d = dims[u], K = int64_t(1) << ibits[u];
            for (int64_t s = 0; s < subs[u]; ++s)
                for (int64_t k = 0; k < K; ++k) {
                    const float* word = tables[u] + (s * K + k) * d;
                    const float* qs = qt.data() + (L.first[u] + s * d) * MP;
                    float* entry = work + (b * E + L.table_at[u] + s * K + k) * MP;
                    for (int64_t v = 0; v < MP; v += 8) {
                        __m256 acc = _mm256_setzero_ps();
                        for (int64_t j = 0; j < d; ++j)
                            acc = _mm256_fmadd_ps(_mm256_set1_ps(word[j]),
                                                  _mm256_loadu_ps(qs + j * MP + v), acc);
                        _mm256_storeu_ps(entry + v, acc);
                    }
                }
        }
    }
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t k0 = chunk_start(blocks, chunks, c), k1 = chunk_start(blocks, chunks, c + 1);
            for (int64_t line = 0; line * LINE < M; ++line) {
                const int64_t rows = M - line * LINE < LINE ? M - line * LINE : LINE;
                scores_by_table(L, work + b * E * MP, MP, line, rows, b, k0, k1,
                                out + b * M * blocks * BLOCK);
            }
        }
}

extern "C" void lorc_vector_sums(const float* p, const uint8_t* const* payloads,
                                 const float* const* tables, const int64_t* subs,
                                 const int64_t* dims, const int64_t* ibits, int64_t runs,
                                 int64_t B, int64_t M, int64_t R, int64_t blocks, float* out,
                                 float* work, int threads) {
    const Layout L(payloads, tables, subs, dims, ibits, runs, R, blocks);
    const int64_t slots = blocks * BLOCK, chunks = threads;
    // work (B, chunks, M, R): each chunk's sums
    std::memset(work, 0, sizeof(float) * B * chunks * M * R);
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < chunks; ++c) {
            std::vector<float> lat(BLOCK * R);  // a block's latents, in L1
            const float* l = lat.data();
            float* sums = work + (b * chunks + c) * M * R;
            const int64_t k0 = chunk_start(blocks, chunks, c), k1 = chunk_start(blocks, chunks, c + 1);
            for (int64_t k = k0; k < k1; ++k) {
                decode_block(L, b, k, lat.data());
                for (int64_t m = 0; m < M; ++m) {
                    const float* w = p + (b * M + m) * slots + k * BLOCK;
                    float* row = sums + m * R;
#pragma omp simd
                    for (int64_t x = 0; x < R; ++x)
                        row[x] += w[0] * l[x] + w[1] * l[R + x] + w[2] * l[2 * R + x] +
                                  w[3] * l[3 * R + x] + w[4] * l[4 * R + x] +
                                  w[5] * l[5 * R + x] + w[6] * l[6 * R + x] + w[7] * l[7 * R + x];
                }
            }
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t x = 0; x < M * R; ++x) {
            float total = 0.f;
            for (int64_t c = 0; c < chunks; ++c) total += work[(b * chunks + c) * M * R + x];
            out[b * M * R + x] = total;
        }
}

// The 8 indices idx packed into one block of IB bytes at p (unpack_block's inverse).
template <int IB>
static inline void pack_block(const int32_t* idx, uint8_t* p) {
    if constexpr (IB == 8) {
        for (int i = 0; i < BLOCK; ++i) p[i] = uint8_t(idx[i]);
    } else if constexpr (IB == 4) {
        for (int j = 0; j < 4; ++j) p[j] = uint8_t(idx[j] | (idx[4 + j] << 4));
    } else if constexpr (IB == 2) {
        for (int j = 0; j < 2; ++j) {
            int32_t byte = 0;
            for (int i = 0; i < 4; ++i) byte |= idx[2 * i + j] << (2 * i);
            p[j] = uint8_t(byte);
        }
    } else {
        uint64_t word = 0;
        for (int i = 0; i < BLOCK; ++i) word |= uint64_t(idx[i]) << (IB * i);
        for (int j = 0; j < IB; ++j) p[j] = uint8_t(word >> (8 * j));
    }
}

// Index `lane` of the block at p set to `index`.
template <int IB>
static inline void set_index(uint8_t* p, int64_t lane, int32_t index) {
    int32_t idx[BLOCK];
    unpack_block<IB>(p, idx);
    idx[lane] = index;
    pack_block<IB>(idx, p);
}

// The nearest of K codewords to x (d channels): the least norms[k] + sum_e scaled[k][e] * x[e]
// (scaled: the codewords times -2), the first of equals, summed in the order
// nearest_codeword.cpp sums (so the two pick the same codeword).
static inline int32_t nearest(const float* x, const float* scaled, const float* norms, int64_t K,
                              int64_t d) {
    float best = __builtin_inff();
    int32_t where = 0;
    for (int64_t k = 0; k < K; ++k) {
        float dist = norms[k];
        for (int64_t e = 0; e < d; ++e) dist += scaled[k * d + e] * x[e];
        if (dist < best) {
            best = dist;
            where = int32_t(k);
        }
    }
    return where;
}

// The static store's write (lorc::vector_rewritten): the blocks a write of T tokens z (B, T, R)
// from token `start` reaches, `staged` of them from block start / 8 of each run's payload
// (B, S, blocks, ib), copied into outs[u] (B, S, staged, ib) with the new tokens' nearest
// codewords' indices packed in. scaled[u] (S, K, d): the codewords times -2; norms[u] (S, K).
extern "C" void lorc_vector_rewrite(const float* z, const float* const* scaled,
                                    const float* const* norms, const uint8_t* const* payloads,
                                    uint8_t* const* outs, const int64_t* subs, const int64_t* dims,
                                    const int64_t* ibits, int64_t runs, int64_t B, int64_t T,
                                    int64_t R, int64_t blocks, int64_t start, int64_t staged) {
    int64_t first = 0;
    for (int64_t u = 0; u < runs; ++u) {
        const int64_t S = subs[u], d = dims[u], ib = ibits[u], K = int64_t(1) << ib;
        for (int64_t b = 0; b < B; ++b)
            for (int64_t s = 0; s < S; ++s) {
                uint8_t* dst = outs[u] + (b * S + s) * staged * ib;
                std::memcpy(dst, payloads[u] + ((b * S + s) * blocks + start / BLOCK) * ib,
                            staged * ib);
                for (int64_t i = 0; i < T; ++i) {
                    const int64_t at = start % BLOCK + i;
                    const int32_t index = nearest(z + (b * T + i) * R + first + s * d,
                                                  scaled[u] + s * K * d, norms[u] + s * K, K, d);
                    uint8_t* block = dst + at / BLOCK * ib;
                    by_index_bits(ib, [&](auto IB) { set_index<IB>(block, at % BLOCK, index); });
                }
            }
        first += S * d;
    }
}

// lorc::vector_decode's body: every slot's latent, out (B, blocks * 8, R), each sub-vector's
// reconstruction copied from its table (the same floats as decoding with tensor ops, which
// unpack every run with a dozen small ops and gather run by run, then concatenate).
extern "C" void lorc_vector_decode(const uint8_t* const* payloads, const float* const* tables,
                                   const int64_t* subs, const int64_t* dims,
                                   const int64_t* ibits, int64_t runs, int64_t B, int64_t R,
                                   int64_t blocks, float* out, int threads) {
    const Layout L(payloads, tables, subs, dims, ibits, runs, R, blocks);
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> lat(BLOCK * R);  // a block's latents, in L1, then copied out whole
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t k = 0; k < blocks; ++k) {
                decode_block(L, b, k, lat.data());
                std::memcpy(out + (b * blocks + k) * BLOCK * R, lat.data(),
                            sizeof(float) * BLOCK * R);
            }
    }
}

// ROWS query rows' dot products with TOGETHER consecutive slots' turned latents t (W floats a
// slot, a multiple of LINE), each row's (alpha, beta) W floats apart at a: a row's load serves
// the slots at once, and their ROWS * TOGETHER chains of multiply-adds run side by side (one
// slot's, one accumulator a row, were bound by the loads and the chains' latency).
constexpr int TOGETHER = 4;
static_assert(BLOCK % TOGETHER == 0, "a block is whole groups of slots");
template <int ROWS>
static inline void turned_dots(const float* t, const float* a, int64_t W, float* out,
                               int64_t out_stride) {
    Line acc[ROWS][TOGETHER];
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < TOGETHER; ++j) acc[r][j] = Line::zero();
    for (int64_t x = 0; x < W; x += LINE) {
        Line v[TOGETHER];
        for (int j = 0; j < TOGETHER; ++j) v[j] = Line::load(t + j * W + x);
        for (int r = 0; r < ROWS; ++r) {
            const Line w = Line::load(a + r * W + x);
            for (int j = 0; j < TOGETHER; ++j) acc[r][j].fma(v[j], w);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < TOGETHER; ++j) out[r * out_stride + j] = acc[r][j].sum();
}

// M rows in groups of at most 5 (5 * TOGETHER accumulators and TOGETHER operands fit the 32
// vector registers of AVX-512; AVX2's 16 spill, as measured acceptable), as even as they come.
static inline void turned_dots(int64_t M, const float* t, const float* a, int64_t W,
                               float* out, int64_t out_stride) {
    const int64_t groups = (M + 4) / 5;
    for (int64_t g = 0, m = 0; g < groups; ++g) {
        const int64_t rows = (M - m) / (groups - g), at = m;
        m += rows;
        const float* ag = a + at * W;
        float* og = out + at * out_stride;
        switch (rows) {
            case 1: turned_dots<1>(t, ag, W, og, out_stride); break;
            case 2: turned_dots<2>(t, ag, W, og, out_stride); break;
            case 3: turned_dots<3>(t, ag, W, og, out_stride); break;
            case 4: turned_dots<4>(t, ag, W, og, out_stride); break;
            default: turned_dots<5>(t, ag, W, og, out_stride);
        }
    }
}

// One slot's turned latent: turned[x] = z[x] * c[pair[x]], turned[R16 + x] = z[x] * s[pair[x]]
// (R16 channels, padded with zeros). Where the angle table fits two 16-float registers
// (P <= 32: head dims up to 64) a channel's angle is one lane of a permute, 16 channels an
// instruction; else gathered, 8 channels an instruction (on this CPU the gathers took most of
// the kernel's time).
static inline void turn_slot(const float* z, const float* c, const float* s,
                             const int32_t* pair, int64_t P, int64_t R16, float* turned) {
#ifdef __AVX512F__
    if (P <= 32) {
        const __mmask16 lo = P >= 16 ? 0xFFFF : __mmask16((1u << P) - 1);
        const __mmask16 hi = P >= 32 ? 0xFFFF : P > 16 ? __mmask16((1u << (P - 16)) - 1) : 0;
        const __m512 c0 = _mm512_maskz_loadu_ps(lo, c), c1 = _mm512_maskz_loadu_ps(hi, c + 16);
        const __m512 s0 = _mm512_maskz_loadu_ps(lo, s), s1 = _mm512_maskz_loadu_ps(hi, s + 16);
        for (int64_t x = 0; x < R16; x += 16) {
            const __m512i at = _mm512_loadu_si512(pair + x);
            const __m512 v = _mm512_loadu_ps(z + x);
            _mm512_storeu_ps(turned + x, _mm512_mul_ps(v, _mm512_permutex2var_ps(c0, at, c1)));
            _mm512_storeu_ps(turned + R16 + x,
                             _mm512_mul_ps(v, _mm512_permutex2var_ps(s0, at, s1)));
        }
        return;
    }
#endif
    for (int64_t x = 0; x < R16; x += 8) {
        const __m256i at = _mm256_loadu_si256((const __m256i*)(pair + x));
        const __m256 v = _mm256_loadu_ps(z + x);
        _mm256_storeu_ps(turned + x, _mm256_mul_ps(v, _mm256_i32gather_ps(c, at, 4)));
        _mm256_storeu_ps(turned + R16 + x, _mm256_mul_ps(v, _mm256_i32gather_ps(s, at, 4)));
    }
}

// lorc::vector_turned_scores' body: ab (B, M, 2R), each query row's alpha then beta over the
// latent's channels; cos, sin (B, blocks * 8, P): each slot's angle table, one value a rotary
// pair; pair (R): each channel's pair. out (B, M, blocks * 8): sum_c z_c * (cos_pair(c) *
// alpha_c + sin_pair(c) * beta_c) for every slot's decoded latent z: each block's 8 latents
// decoded into L1, each slot's turned (turn_slot), then dotted with the rows TOGETHER slots at
// a time (turned_dots).
extern "C" void lorc_vector_turned_scores(const float* ab, const float* cos, const float* sin,
                                          const int32_t* pair, int64_t P,
                                          const uint8_t* const* payloads,
                                          const float* const* tables, const int64_t* subs,
                                          const int64_t* dims, const int64_t* ibits, int64_t runs,
                                          int64_t B, int64_t M, int64_t R, int64_t blocks,
                                          float* out, int threads) {
    const Layout L(payloads, tables, subs, dims, ibits, runs, R, blocks);
    const int64_t slots = blocks * BLOCK, R16 = (R + 15) / 16 * 16, W = 2 * R16;
    std::vector<float> padded(B * M * W, 0.f);  // ab, each half padded to R16 channels
    std::vector<int32_t> pairs(R16, 0);
    for (int64_t x = 0; x < R; ++x) pairs[x] = pair[x];
    for (int64_t row = 0; row < B * M; ++row)
        for (int64_t half = 0; half < 2; ++half)
            std::memcpy(padded.data() + row * W + half * R16, ab + row * 2 * R + half * R,
                        sizeof(float) * R);
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> lat(BLOCK * R16, 0.f), turned(BLOCK * W, 0.f);  // in L1
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t k = 0; k < blocks; ++k) {
                decode_block(L, b, k, lat.data(), R16);
                for (int64_t i = 0; i < BLOCK; ++i) {
                    const int64_t t = k * BLOCK + i;
                    turn_slot(lat.data() + i * R16, cos + (b * slots + t) * P,
                              sin + (b * slots + t) * P, pairs.data(), P, R16,
                              turned.data() + i * W);
                }
                for (int64_t i = 0; i < BLOCK; i += TOGETHER)
                    turned_dots(M, turned.data() + i * W, padded.data() + b * M * W, W,
                                out + b * M * slots + k * BLOCK + i, slots);
            }
    }
}
