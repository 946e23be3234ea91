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
//   entry's dot products with the M query rows, table_q (E, M) (M * sum_u S_u K_u d_u
//   multiply-adds a step); then a slot's M scores are the sum of its sub-vectors' entries'
//   rows: one lookup of M contiguous floats a sub-vector, instead of R multiply-adds a row
//   over a decoded latent.
// - lorc_vector_sums: weights p (B, M, blocks * 8) over every slot: out (B, M, R) = sum_j
//   p[., j] * latent_j. Each block's 8 latents are decoded into L1 (decode_rows) and added in,
//   weighted, to the M rows of out: the latent is never written to memory.
//
// Scores sum in float32 in another order than decoding and multiplying; sums decode and
// multiply, a block at a time. Slots are split in `threads` chunks (sums: each into its own
// rows, work: B * chunks * M * R floats, added up at the end). Measured on the 2-core x86-64
// (Zen 5) machine, one thread, 4096 slots of the default 2.56-bit plan's 30 layers, M = 9: the
// scores' table 15 ms against 18 decoding the side and multiplying; the sums decoded a block
// at a time 24.5 ms against 44.8 by per-codeword sums of the weights (a table of E * M floats
// read and written once a sub-vector a slot; bench/results/long_context_vector-cpu.md, run
// 10) and ~22 decoding the whole side and multiplying (bench/vector_reductions.py times the
// ops: bench/results/vector_reductions-cpu.md).
//
// lorc_vector_rewrite, at the end, is a static store's write (lorc::vector_rewritten), and
// lorc_vector_decode, last, a side's latents decoded (lorc::vector_decode on CPUs).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

constexpr int64_t BLOCK = 8;  // tokens whose indices pack together
constexpr int64_t ROWS = 32;  // query rows a pass over the slots serves (4 vectors)

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

// Block k of every sub-vector of one run (S of them, `stride` bytes apart), as table entries
// from `base` (K a sub-vector), token by token `pitch` apart: at[i * pitch + s].
template <int IB>
static void run_entries(const uint8_t* row, int64_t S, int64_t stride, int32_t base,
                        int64_t pitch, int32_t* at) {
    int32_t idx[BLOCK];
    for (int64_t s = 0; s < S; ++s) {
        unpack_block<IB>(row + s * stride, idx);
        const int32_t first = base + int32_t(s << IB);
        for (int i = 0; i < BLOCK; ++i) at[i * pitch + s] = idx[i] + first;
    }
}

struct Layout {
    const uint8_t* const* payloads;
    const float* const* tables;
    const int64_t *subs, *dims, *ibits;
    int64_t runs, R, blocks;
    std::vector<int64_t> first, table_at, sub_at;  // per run: first channel, table entry, sub
    int64_t entries = 0, sub_total = 0;            // sum_u S_u * K_u, sum_u S_u

    Layout(const uint8_t* const* p, const float* const* t, const int64_t* s, const int64_t* d,
           const int64_t* ib, int64_t runs_, int64_t R_, int64_t blocks_)
        : payloads(p), tables(t), subs(s), dims(d), ibits(ib), runs(runs_), R(R_),
          blocks(blocks_) {
        int64_t channel = 0;
        for (int64_t u = 0; u < runs; ++u) {
            first.push_back(channel);
            table_at.push_back(entries);
            sub_at.push_back(sub_total);
            channel += subs[u] * dims[u];
            entries += subs[u] * (int64_t(1) << ibits[u]);
            sub_total += subs[u];
        }
    }

    // Every sub-vector's 8 indices of block `k` of row b, as entries of the table of all
    // runs, token by token: at[i * sub_total + sub] = table entry of token i's sub-vector.
    void entries_of_block(int64_t b, int64_t k, int32_t* at) const {
        for (int64_t u = 0; u < runs; ++u) {
            const int64_t ib = ibits[u], S = subs[u], stride = blocks * ib;
            const uint8_t* row = payloads[u] + b * S * blocks * ib + k * ib;
            int32_t* out = at + sub_at[u];
            const int32_t base = int32_t(table_at[u]);
            switch (ib) {
                case 1: run_entries<1>(row, S, stride, base, sub_total, out); break;
                case 2: run_entries<2>(row, S, stride, base, sub_total, out); break;
                case 3: run_entries<3>(row, S, stride, base, sub_total, out); break;
                case 4: run_entries<4>(row, S, stride, base, sub_total, out); break;
                case 5: run_entries<5>(row, S, stride, base, sub_total, out); break;
                case 6: run_entries<6>(row, S, stride, base, sub_total, out); break;
                case 7: run_entries<7>(row, S, stride, base, sub_total, out); break;
                default: run_entries<8>(row, S, stride, base, sub_total, out);
            }
        }
    }
};

// One token's S sub-vectors of D channels each, copied from their table rows (entry[s]:
// sub-vector s's entry, counted from `first`, the run's first): single channels 8 at a time
// and pairs 4 at a time by one gather (a pair moved as one 64-bit lane), longer ones by a copy
// of constant size.
template <int D>
static inline void copy_subs(float* channels, const float* table, const int32_t* entry, int64_t S,
                             int32_t first) {
    int64_t s = 0;
    if constexpr (D == 1) {
        const __m256i from = _mm256_set1_epi32(first);
        for (; s + 8 <= S; s += 8) {
            const __m256i at = _mm256_sub_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(entry + s)), from);
            _mm256_storeu_ps(channels + s, _mm256_i32gather_ps(table, at, 4));
        }
    } else if constexpr (D == 2) {
        const __m128i from = _mm_set1_epi32(first);
        for (; s + 4 <= S; s += 4) {
            const __m128i at = _mm_sub_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(entry + s)), from);
            _mm256_storeu_pd(reinterpret_cast<double*>(channels + s * 2),
                             _mm256_i32gather_pd(reinterpret_cast<const double*>(table), at, 8));
        }
    }
    for (; s < S; ++s)
        std::memcpy(channels + s * D, table + int64_t(entry[s] - first) * D, D * sizeof(float));
}

// The 8 latents of a block whose entries are `at` (entries_of_block), each R floats of lat.
static void decode_rows(const Layout& L, const int32_t* at, float* lat) {
    for (int64_t i = 0; i < BLOCK; ++i)
        for (int64_t u = 0; u < L.runs; ++u) {
            const int32_t* entry = at + i * L.sub_total + L.sub_at[u];
            float* channels = lat + i * L.R + L.first[u];
            const float* table = L.tables[u];
            const int64_t S = L.subs[u];
            const int32_t first = int32_t(L.table_at[u]);
            // the caller checks that every run's d is one of these five
            switch (L.dims[u]) {
                case 1: copy_subs<1>(channels, table, entry, S, first); break;
                case 2: copy_subs<2>(channels, table, entry, S, first); break;
                case 4: copy_subs<4>(channels, table, entry, S, first); break;
                case 8: copy_subs<8>(channels, table, entry, S, first); break;
                default: copy_subs<16>(channels, table, entry, S, first);
            }
        }
}

static inline int64_t chunk_start(int64_t blocks, int64_t chunks, int64_t c) {
    return blocks * c / chunks;
}

// The lanes of a vector of query rows past `tail` rows masked out (all on for a whole one).
static inline __m256i rows_mask(int64_t tail) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(tail)), lanes);
}

// Scores of row b's blocks k0..k1 for query rows r0..r0+rows of table_q (E, M), NV vectors of
// rows (the last one masked to `rows`), two slots at a time (independent sums in flight).
// out (M, slots).
template <int NV>
static void scores_by_table(const Layout& L, const float* tq, int64_t M, int64_t r0,
                            int64_t rows, int64_t b, int64_t k0, int64_t k1, float* out,
                            int32_t* at) {
    const int64_t slots = L.blocks * BLOCK, subs = L.sub_total;
    const __m256i last = rows_mask(rows - (NV - 1) * 8);
    alignas(32) float tile[BLOCK][ROWS];
    for (int64_t k = k0; k < k1; ++k) {
        L.entries_of_block(b, k, at);
        for (int64_t i = 0; i < BLOCK; i += 2) {
            __m256 acc[2][NV];
            for (int v = 0; v < NV; ++v) acc[0][v] = acc[1][v] = _mm256_setzero_ps();
            for (int64_t s = 0; s < subs; ++s)
                for (int h = 0; h < 2; ++h) {
                    const float* e = tq + int64_t(at[(i + h) * subs + s]) * M + r0;
                    for (int v = 0; v < NV - 1; ++v)
                        acc[h][v] = _mm256_add_ps(acc[h][v], _mm256_loadu_ps(e + v * 8));
                    acc[h][NV - 1] = _mm256_add_ps(
                        acc[h][NV - 1], _mm256_maskload_ps(e + (NV - 1) * 8, last));
                }
            for (int h = 0; h < 2; ++h)
                for (int v = 0; v < NV; ++v) _mm256_store_ps(tile[i + h] + v * 8, acc[h][v]);
        }
        for (int64_t m = 0; m < rows; ++m)
            for (int64_t i = 0; i < BLOCK; ++i) out[(r0 + m) * slots + k * BLOCK + i] = tile[i][m];
    }
}

extern "C" void lorc_vector_scores(const float* q, const uint8_t* const* payloads,
                                   const float* const* tables, const int64_t* subs,
                                   const int64_t* dims, const int64_t* ibits, int64_t runs,
                                   int64_t B, int64_t M, int64_t R, int64_t blocks, float* out,
                                   float* work, int threads) {
    const Layout L(payloads, tables, subs, dims, ibits, runs, R, blocks);
    const int64_t E = L.entries, slots = blocks * BLOCK, chunks = threads;
    // work (B, E, M): every entry's dot products with the query rows, 8 rows a vector
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        const int64_t MP = (M + 7) / 8 * 8;
        std::vector<float> qt(R * MP, 0.f);  // the query rows transposed, (R, MP)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t c = 0; c < R; ++c) qt[c * MP + m] = q[(b * M + m) * R + c];
        for (int64_t u = 0; u < runs; ++u) {
            const int64_t d = dims[u], K = int64_t(1) << ibits[u];
            for (int64_t s = 0; s < subs[u]; ++s)
                for (int64_t k = 0; k < K; ++k) {
                    const float* word = tables[u] + (s * K + k) * d;
                    const float* qs = qt.data() + (L.first[u] + s * d) * MP;
                    float* entry = work + (b * E + L.table_at[u] + s * K + k) * M;
                    for (int64_t v = 0; v < MP; v += 8) {
                        __m256 acc = _mm256_setzero_ps();
                        for (int64_t j = 0; j < d; ++j)
                            acc = _mm256_fmadd_ps(_mm256_set1_ps(word[j]),
                                                  _mm256_loadu_ps(qs + j * MP + v), acc);
                        if (v + 8 <= M) {
                            _mm256_storeu_ps(entry + v, acc);
                        } else {  // the last rows, not past them (another row's table)
                            alignas(32) float last[8];
                            _mm256_store_ps(last, acc);
                            std::memcpy(entry + v, last, sizeof(float) * (M - v));
                        }
                    }
                }
        }
    }
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < chunks; ++c) {
            std::vector<int32_t> at(L.sub_total * BLOCK);
            const int64_t k0 = chunk_start(blocks, chunks, c), k1 = chunk_start(blocks, chunks, c + 1);
            for (int64_t r0 = 0; r0 < M; r0 += ROWS) {  // passes of NV vectors of rows
                const int64_t rows = M - r0 < ROWS ? M - r0 : ROWS;
                const float* tq = work + b * E * M;
                float* ob = out + b * M * slots;
                switch ((rows + 7) / 8) {
                    case 1: scores_by_table<1>(L, tq, M, r0, rows, b, k0, k1, ob, at.data()); break;
                    case 2: scores_by_table<2>(L, tq, M, r0, rows, b, k0, k1, ob, at.data()); break;
                    case 3: scores_by_table<3>(L, tq, M, r0, rows, b, k0, k1, ob, at.data()); break;
                    default: scores_by_table<4>(L, tq, M, r0, rows, b, k0, k1, ob, at.data());
                }
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
            std::vector<int32_t> at(L.sub_total * BLOCK);
            std::vector<float> lat(BLOCK * R);  // a block's latents, in L1
            const float* l = lat.data();
            float* sums = work + (b * chunks + c) * M * R;
            const int64_t k0 = chunk_start(blocks, chunks, c), k1 = chunk_start(blocks, chunks, c + 1);
            for (int64_t k = k0; k < k1; ++k) {
                L.entries_of_block(b, k, at.data());
                decode_rows(L, at.data(), lat.data());
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
                    switch (ib) {
                        case 1: set_index<1>(block, at % BLOCK, index); break;
                        case 2: set_index<2>(block, at % BLOCK, index); break;
                        case 3: set_index<3>(block, at % BLOCK, index); break;
                        case 4: set_index<4>(block, at % BLOCK, index); break;
                        case 5: set_index<5>(block, at % BLOCK, index); break;
                        case 6: set_index<6>(block, at % BLOCK, index); break;
                        case 7: set_index<7>(block, at % BLOCK, index); break;
                        default: set_index<8>(block, at % BLOCK, index);
                    }
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
        std::vector<int32_t> at(L.sub_total * BLOCK);  // a block's entries, this thread's
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t k = 0; k < blocks; ++k) {
                L.entries_of_block(b, k, at.data());
                decode_rows(L, at.data(), out + (b * blocks + k) * BLOCK * R);
            }
    }
}
