// The AVX-512 decode / short-verify path of cpu_attention.cpp: run_item_fast and its helpers.
// A fragment, not a standalone header: cpu_attention.cpp includes it inside its anonymous
// namespace, after Args, Scratch and the portable path, when SPECSERVE_AVX512 is defined
// (immintrin.h is included there).
#pragma once

// Every query vector scores the block's 16 keys as 16 lane-wise partial dot products, and one
// transpose-and-add tree turns those 16 vectors into one vector of 16 scores (15 adds, 30
// shuffles) instead of 16 horizontal sums. A block's softmax is then a few vector ops, and V is
// read once per 4 query vectors. Measured against run_item (64 requests x ~200 keys, SmolLM2
// shapes, fp32 KV): 2x at 1 row a request (decode), 2x at 4 and 8, 1.9x at 16 (prefill chunks).

// exp_nonpos on 16 lanes: the same reduction and polynomial, 2^n by vscalefps.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16 -> fp32: the 16 bits become the high half
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane 4k+e of the result = the sum of v[4e+k]'s lanes (callers put key 4k+e in slot 4e+k).
// Each add only combines partials of one input, so a NaN key stays in its own lane.
inline __m512 sum16(__m512* v) {
    __m512 w[8], x[4], y[2];
    for (int j = 0; j < 8; ++j)  // 256-bit halves: [v2j (8 partials) | v2j+1]
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; ++j)  // 128-bit lane k: 4 partials of v[4j+k]
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; ++j)  // lane k: 2 partials of v[8j+k], 2 of v[8j+4+k]
        y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// acc[j] = acc[j] * corr[j] + sum_t p[j][t] V[t] for NQ vectors over keys [lo, hi) of a block.
template <typename KV, int DT, int NQ>
inline void pv_block(float* acc, const float* p, const float* corr, const KV* vb,
                     int64_t tok_stride, int lo, int hi) {
    constexpr int C = DT / 16;
    __m512 ac[NQ][C];
    for (int j = 0; j < NQ; ++j) {
        const __m512 cj = _mm512_set1_ps(corr[j]);
        for (int c = 0; c < C; ++c)
            ac[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * DT + c * 16), cj);
    }
    for (int t = lo; t < hi; ++t) {
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = load16(vb + t * tok_stride + c * 16);
        for (int j = 0; j < NQ; ++j) {
            const __m512 w = _mm512_set1_ps(p[j * 16 + t]);
            for (int c = 0; c < C; ++c) ac[j][c] = _mm512_fmadd_ps(w, v[c], ac[j][c]);
        }
    }
    for (int j = 0; j < NQ; ++j)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * DT + c * 16, ac[j][c]);
}

// Start loading one key's K and V rows of a later block into L1.
template <typename KV, int DT>
inline void prefetch_row(const KV* k, const KV* v) {
    for (int off = 0; off < DT * static_cast<int>(sizeof(KV)); off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k) + off, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v) + off, _MM_HINT_T0);
    }
}

// run_item for block_size 16 and head_dim DT.
template <typename KV, int DT>
void run_item_fast(const Args& a, int req, int row0, int row1, int kvh, Scratch& s) {
    constexpr int BS = 16, C = DT / 16, QG = C <= 4 ? 4 : 2;  // QG: vectors per V pass
    const int g_per = a.heads / a.kv_heads;
    const int nrows = row1 - row0, nq = nrows * g_per;
    const int ql = a.q_lens[req], cl = a.ctx_lens[req], start = a.starts[req];
    const int first_pos = cl - ql + row0;
    const int64_t tok_stride = static_cast<int64_t>(a.kv_heads) * DT, blk_stride = tok_stride * BS;
    s.q.resize(static_cast<size_t>(nq) * DT);
    s.acc.assign(static_cast<size_t>(nq) * DT, 0.0f);
    s.m.assign(nq, -FLT_MAX);
    s.l.assign(nq, 0.0f);
    s.scores.resize(static_cast<size_t>(nq) * (BS + 1));
    float* prob = s.scores.data();  // [nq][16] this block's softmax numerators
    float* corr = prob + nq * BS;   // [nq] rescale of the accumulators for this block
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int n = 0; n < nq; ++n) {
        const float* src = a.q + (start + row0 + n / g_per) * a.q_row_stride +
                           (kvh * g_per + n % g_per) * a.q_head_stride;
        for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(s.q.data() + n * DT + c * 16,
                             _mm512_mul_ps(_mm512_loadu_ps(src + c * 16), scale));
    }
    const int klo = a.window ? std::max(0, first_pos - a.window + 1) : 0;
    const int khi = first_pos + nrows;
    const int32_t* table = a.block_tables + req * a.bt_stride;
    const KV* kbase = static_cast<const KV*>(a.k) + kvh * DT;
    const KV* vbase = static_cast<const KV*>(a.v) + kvh * DT;
    for (int b0 = klo / BS * BS; b0 < khi; b0 += BS) {
        const int64_t blk = table[b0 / BS];
        const KV* kb = kbase + blk * blk_stride;
        const KV* vb = vbase + blk * blk_stride;
        // The next block lies anywhere (no hardware prefetcher guesses it): its rows are
        // prefetched one key at a time, spread over this block's scoring (1.5x at decode). A
        // burst of them at the block's start gained nothing (likely stalled on the miss buffers).
        const bool has_next = b0 + BS < khi;
        const int64_t nxt = has_next ? table[b0 / BS + 1] : blk;
        const KV* kn = kbase + nxt * blk_stride;
        const KV* vn = vbase + nxt * blk_stride;
        const int t_lo = std::max(klo, b0) - b0, t_hi = std::min(khi, b0 + BS) - b0;
        for (int n = 0; n < nq; ++n) {
            const int p = first_pos + n / g_per;
            const int lo = std::max(t_lo, (a.window ? p - a.window + 1 : 0) - b0);
            const int hi = std::min(t_hi, p + 1 - b0);
            float* pr = prob + n * BS;
            corr[n] = 1.0f;
            if (lo >= hi) {  // the row sees none of this block: its state stays
                _mm512_storeu_ps(pr, _mm512_setzero_ps());
                continue;
            }
            __m512 qr[C], part[16];
            for (int c = 0; c < C; ++c) qr[c] = _mm512_loadu_ps(s.q.data() + n * DT + c * 16);
            for (int slot = 0; slot < 16; ++slot) {
                if (has_next && n == 0)
                    prefetch_row<KV, DT>(kn + slot * tok_stride, vn + slot * tok_stride);
                const KV* kr = kb + ((slot & 3) * 4 + (slot >> 2)) * tok_stride;  // see sum16
                __m512 dot = _mm512_mul_ps(qr[0], load16(kr));
                for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qr[c], load16(kr + c * 16), dot);
                part[slot] = dot;
            }
            // keys outside [lo, hi) may be unwritten memory (NaN): masked out of the max and
            // the sum, and their V rows are not read
            const __mmask16 mask = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
            const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask, sum16(part));
            const float m = s.m[n], mx = std::max(m, _mm512_reduce_max_ps(sc));
            const __m512 e =
                _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
            corr[n] = exp_nonpos(m - mx);
            s.l[n] = s.l[n] * corr[n] + _mm512_reduce_add_ps(e);
            s.m[n] = mx;
            _mm512_storeu_ps(pr, e);
        }
        for (int n = 0; n < nq; n += QG) {
            float* an = s.acc.data() + static_cast<size_t>(n) * DT;
            const float *pn = prob + n * BS, *cn = corr + n;
            switch (std::min(QG, nq - n)) {
                case 4: pv_block<KV, DT, 4>(an, pn, cn, vb, tok_stride, t_lo, t_hi); break;
                case 3: pv_block<KV, DT, 3>(an, pn, cn, vb, tok_stride, t_lo, t_hi); break;
                case 2: pv_block<KV, DT, 2>(an, pn, cn, vb, tok_stride, t_lo, t_hi); break;
                default: pv_block<KV, DT, 1>(an, pn, cn, vb, tok_stride, t_lo, t_hi);
            }
        }
    }
    for (int n = 0; n < nq; ++n) {
        const __m512 inv = _mm512_set1_ps(1.0f / s.l[n]);  // l > 0: every row sees itself
        float* dst = a.out + (static_cast<int64_t>(start + row0 + n / g_per) * a.heads +
                              kvh * g_per + n % g_per) * DT;
        for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(dst + c * 16,
                             _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + n * DT + c * 16), inv));
    }
}
