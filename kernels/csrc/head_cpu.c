/* The CPU head's draft + argmax on AMX (or AVX512-BF16): bf16 GEMMs with fp32 sums, reduced in cache.

What it does
    For y bf16 [N, H] (the normalised activation) and W bf16 [V, H] (the LM head), with s[t, v]
    = y[t] . W[v] summed in fp32:
      pass 1 (`ef_draft_argmax`): one walk over the vocabulary in id order keeps, per token t,
        the argmax over all V columns (ties: the lowest id, as ids ascend), the running max and
        float64 sum of exp(s - max) over the draft columns (their logsumexp) and, when asked,
        over every column (the full lse). Nothing is written per column.
      pass 2 (`ef_draft_out`): the draft columns again, out[t, d] = s[t, draft_ids[d]] - lse_d[t]
        rounded once to fp32 or bf16 (nearest-even), written as contiguous rows; or, where pass
        1 was given somewhere to store each token's draft logits (the fp32 output itself, or a
        scratch for a group of tokens), `ef_draft_fix` turns those into the same bytes.
    Python (`kernels/_native.py`) packs the operands, merges pass 1's per-segment statistics
    and hands pass 2 the draft logsumexp.

Design
    Pass 1 computes s transposed, s^T = W y^T: W's rows are the A operand as they lie in memory
    (no packing, no gather) and y is packed once per call into the VNNI layout of the B operand
    (`ef_pack_y`). A [32 vocab x 32 token] block is four 16 x 16 fp32 AMX tiles (TDPBF16PS; or,
    on CPUs without AMX, 16 AVX-512 accumulators per 8 rows, VDPBF16PS: `block_avx512`);
    each tile row is one vocab id across 16 tokens, so the per-token reductions are lane-wise
    vector maxima and sums (and a stored draft logit is a transposed copy of a tile row). The vocabulary is cut into segments fixed by V alone (never by the
    thread count); a thread takes whole segments, each segment keeps its own per-token
    statistics, merged in segment order afterwards. Within a segment: chunks of W rows that
    stay in L2, each swept by the token blocks of a group that stays in the last-level cache.
    Pass 2 computes s itself, y W_d^T: y's rows are A as they lie, the draft rows of W (gathered
    and packed once per call) are B, and each tile row is one token's run of draft columns.
    Both passes run the same block kernel, which adds the same products in the same k order
    whichever operand is A, so pass 2 reproduces pass 1's logits and the log-probs sum to one
    as the logsumexp says (the AMX and AVX512-BF16 kernels differ from each other by fp32
    rounding). Every logit's summation order is fixed by H
    alone and no reduction depends on the thread split: the same bits for any thread count.

Limits
    H a multiple of 32; finite logits (the caller checks ||y|| ||w|| < 2^120); V < 2^31. The
    caller has the AMX tile state granted (`ef_amx_init`) when it asks for AMX. Products of bf16
    values are exact in fp32; both instruction sets add them in fp32 with denormals flushed
    (DAZ/FTZ), which the caller's error bounds cover.
*/
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))

/* Ask the kernel for the AMX tile state (Linux 5.16+); 0 when granted. */
int ef_amx_init(void) {
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return -1;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask)) return -2;
    return (bitmask & (1UL << XFEATURE_XTILEDATA)) ? 0 : -3;
}

/* y bf16 [N, H] (row stride ldy) -> yp, the B operand in VNNI pairs: for each 16-token block tb
   and 32-wide k block kb, 16 rows (k pairs) x 16 tokens x 2 values; tokens past N are zero. */
void ef_pack_y(const uint16_t *y, int64_t N, int64_t H, int64_t ldy, uint32_t *yp) {
    int64_t KB = H / 32, NB = (N + 15) / 16;
    for (int64_t tb = 0; tb < NB; tb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint32_t *dst = yp + (tb * KB + kb) * 256;
            for (int t = 0; t < 16; t++) {
                int64_t row = tb * 16 + t;
                const uint32_t *src = (const uint32_t *)(y + row * ldy + kb * 32);
                for (int p = 0; p < 16; p++) dst[p * 16 + t] = row < N ? src[p] : 0u;
            }
        }
}

typedef struct {
    const uint16_t *w;  /* [V, H] bf16, row stride ldw */
    int64_t ldw, V, H;
    const uint32_t *yp; /* ef_pack_y's output */
    int64_t N;
    const uint32_t *dmask; /* [ceil(V / 32)]: which rows of each aligned 32-row block are draft ids */
    int64_t seg_rows, nseg, chunk_rows, group_rows;
    float *best, *dmax;  /* [nseg, Npad] */
    int32_t *arg;
    double *dsum;
    double *asum; /* [nseg, Npad] or NULL: the sum of exp(s - best) over every column (lse) */
    float *logits; /* [N, ld_logits] or NULL: the draft logits, stored as pass 1 meets them */
    int64_t ld_logits;
    const int32_t *dpos; /* [ceil(V / 32)]: the draft position of each block's first draft id */
    int use_amx; /* AMX tiles, else AVX512-BF16 */
    int next;    /* the next segment to take */
    int done;    /* segments walked: all of them, unless no thread could allocate its scratch */
} job_t;

/* exp(x) for x <= 0 (Cephes expf's polynomial, within 2 ulp); -inf and x < -103 give ~0. */
static inline AVX512 __m512 vexp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Per-token state of one 16-token half of a block, held in registers across a chunk. */
typedef struct {
    __m512 best, dmax;
    __m512i arg;
    __m512d sum_lo, sum_hi;   /* draft columns, relative to dmax */
    __m512d asum_lo, asum_hi; /* every column, relative to best (when the lse is asked for) */
} lanes_t;

/* acc (16 fp32 lanes) added to sum (two halves of 8 float64) after scaling sum by scale */
static inline AVX512 void rescale_add(__m512d *lo, __m512d *hi, __m512 scale, __m512 acc) {
    *lo = _mm512_fmadd_pd(*lo, _mm512_cvtps_pd(_mm512_castps512_ps256(scale)),
                          _mm512_cvtps_pd(_mm512_castps512_ps256(acc)));
    *hi = _mm512_fmadd_pd(*hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(scale, 1)),
                          _mm512_cvtps_pd(_mm512_extractf32x8_ps(acc, 1)));
}

/* Reduce one [rows x 16] fp32 slab c (row stride 32 floats: one vocab id per row, ids v0 + i;
   one token per lane, tokens t0 + j for j < nt) into the lanes; with job->logits, store its
   draft rows there too (token-major: a transpose of the slab's draft rows). */
static inline AVX512 void epilogue(const job_t *job, const float *c, int rows, int64_t v0, int64_t t0, int nt,
                                   lanes_t *s) {
    /* argmax over every row: only rows that beat the running best matter */
    __m512 bm = _mm512_loadu_ps(c);
    for (int i = 1; i < rows; i++) bm = _mm512_max_ps(bm, _mm512_loadu_ps(c + 32 * i));
    __m512 old_best = s->best;
    if (_mm512_cmp_ps_mask(bm, s->best, _CMP_GT_OQ)) {
        for (int i = 0; i < rows; i++) {
            __m512 x = _mm512_loadu_ps(c + 32 * i);
            __mmask16 m = _mm512_cmp_ps_mask(x, s->best, _CMP_GT_OQ);
            s->best = _mm512_mask_mov_ps(s->best, m, x);
            s->arg = _mm512_mask_mov_epi32(s->arg, m, _mm512_set1_epi32((int32_t)(v0 + i)));
        }
    }
    if (job->asum) { /* the full-vocabulary logsumexp, relative to the running best */
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < rows; i++) acc = _mm512_add_ps(acc, vexp(_mm512_sub_ps(_mm512_loadu_ps(c + 32 * i), s->best)));
        rescale_add(&s->asum_lo, &s->asum_hi, vexp(_mm512_sub_ps(old_best, s->best)), acc);
    }
    /* the draft rows: a bit mask per aligned 32-row block, walked with tzcnt, so no branch
       depends on the data */
    uint32_t mask = job->dmask[v0 / 32];
    if (rows < 32) mask &= (1u << rows) - 1u;
    if (!mask) return;
    __m512 m = s->dmax;
    for (uint32_t b = mask; b; b &= b - 1) m = _mm512_max_ps(m, _mm512_loadu_ps(c + 32 * __builtin_ctz(b)));
    __m512 acc = _mm512_setzero_ps();
    for (uint32_t b = mask; b; b &= b - 1)
        acc = _mm512_add_ps(acc, vexp(_mm512_sub_ps(_mm512_loadu_ps(c + 32 * __builtin_ctz(b)), m)));
    rescale_add(&s->sum_lo, &s->sum_hi, vexp(_mm512_sub_ps(s->dmax, m)), acc);
    s->dmax = m;
    if (job->logits) {
        float *dst = job->logits + t0 * job->ld_logits + job->dpos[v0 / 32];
        int64_t ld = job->ld_logits;
        for (uint32_t b = mask; b; b &= b - 1, dst++) {
            const float *row = c + 32 * __builtin_ctz(b);
            for (int t = 0; t < nt; t++) dst[t * ld] = row[t];
        }
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* One [32 x 32] fp32 block c (row stride 32) = A B: A's 32 rows (bf16, row stride lda, k
   contiguous: W's rows in pass 1, y's in pass 2) against two 16-lane halves b0, b1 of a packed
   operand (`ef_pack_y`'s layout: y in pass 1, W's draft rows in pass 2), over KB blocks of 32 k.
   AMX: tiles 0-3 accumulate, 4-5 hold A's two 16-row halves, 6-7 b0 and b1; the tile
   configuration (set by each thread): palette 1, all eight tiles 16 rows x 64 bytes. */
static inline AMX void block_amx(const uint16_t *a, int64_t lda, const uint32_t *b0, const uint32_t *b1,
                                 int64_t KB, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        _tile_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
        _tile_loadd(6, b0 + kb * 256, 64);
        _tile_loadd(7, b1 + kb * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* The same block with AVX512-BF16 (CPUs without AMX): 8 rows at a time, 16 accumulators; each
   k pair of a row is broadcast against the 16 lanes of b0 and of b1 (VDPBF16PS). */
#define EF_ROW(i)                                                                            \
    {                                                                                        \
        __m512bh x = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(ak + (i) * lda + 2 * p)); \
        acc##i##0 = _mm512_dpbf16_ps(acc##i##0, x, v0);                                      \
        acc##i##1 = _mm512_dpbf16_ps(acc##i##1, x, v1);                                      \
    }
#define EF_STORE(i)                                          \
    _mm512_storeu_ps(c + (r0 + (i)) * 32, acc##i##0);        \
    _mm512_storeu_ps(c + (r0 + (i)) * 32 + 16, acc##i##1);
static inline AVX512 void block_avx512(const uint16_t *a, int64_t lda, const uint32_t *b0, const uint32_t *b1,
                                       int64_t KB, float *c) {
    for (int r0 = 0; r0 < 32; r0 += 8) {
        __m512 acc00 = _mm512_setzero_ps(), acc01 = acc00, acc10 = acc00, acc11 = acc00, acc20 = acc00,
               acc21 = acc00, acc30 = acc00, acc31 = acc00, acc40 = acc00, acc41 = acc00, acc50 = acc00,
               acc51 = acc00, acc60 = acc00, acc61 = acc00, acc70 = acc00, acc71 = acc00;
        for (int64_t kb = 0; kb < KB; kb++) {
            const uint16_t *ak = a + r0 * lda + kb * 32;
            const uint32_t *pb0 = b0 + kb * 256, *pb1 = b1 + kb * 256;
            for (int p = 0; p < 16; p++) {
                __m512bh v0 = (__m512bh)_mm512_loadu_si512(pb0 + p * 16);
                __m512bh v1 = (__m512bh)_mm512_loadu_si512(pb1 + p * 16);
                EF_ROW(0) EF_ROW(1) EF_ROW(2) EF_ROW(3) EF_ROW(4) EF_ROW(5) EF_ROW(6) EF_ROW(7)
            }
        }
        EF_STORE(0) EF_STORE(1) EF_STORE(2) EF_STORE(3) EF_STORE(4) EF_STORE(5) EF_STORE(6) EF_STORE(7)
    }
}

static inline AMX void block(int use_amx, const uint16_t *a, int64_t lda, const uint32_t *b0, const uint32_t *b1,
                             int64_t KB, float *c) {
    if (use_amx)
        block_amx(a, lda, b0, b1, KB, c);
    else
        block_avx512(a, lda, b0, b1, KB, c);
}

static AMX void tiles_on(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

static AVX512 void load_lanes(const job_t *job, int64_t seg, int64_t t0, lanes_t *s) {
    int64_t off = seg * ((job->N + 31) / 32 * 32) + t0;
    s->best = _mm512_loadu_ps(job->best + off);
    s->dmax = _mm512_loadu_ps(job->dmax + off);
    s->arg = _mm512_loadu_si512(job->arg + off);
    s->sum_lo = _mm512_loadu_pd(job->dsum + off);
    s->sum_hi = _mm512_loadu_pd(job->dsum + off + 8);
    s->asum_lo = s->asum_hi = _mm512_setzero_pd();
    if (job->asum) {
        s->asum_lo = _mm512_loadu_pd(job->asum + off);
        s->asum_hi = _mm512_loadu_pd(job->asum + off + 8);
    }
}

static AVX512 void store_lanes(const job_t *job, int64_t seg, int64_t t0, const lanes_t *s) {
    int64_t off = seg * ((job->N + 31) / 32 * 32) + t0;
    _mm512_storeu_ps(job->best + off, s->best);
    _mm512_storeu_ps(job->dmax + off, s->dmax);
    _mm512_storeu_si512(job->arg + off, s->arg);
    _mm512_storeu_pd(job->dsum + off, s->sum_lo);
    _mm512_storeu_pd(job->dsum + off + 8, s->sum_hi);
    if (job->asum) {
        _mm512_storeu_pd(job->asum + off, s->asum_lo);
        _mm512_storeu_pd(job->asum + off + 8, s->asum_hi);
    }
}

static AMX void run_segment(job_t *job, int64_t seg, uint16_t *tail_w, float *c) {
    const int64_t H = job->H, KB = H / 32, ldw = job->ldw;
    const int64_t v_begin = seg * job->seg_rows;
    const int64_t v_end = v_begin + job->seg_rows < job->V ? v_begin + job->seg_rows : job->V;
    /* token groups of group_rows tokens: the packed y a chunk sweeps stays in the last-level cache */
    for (int64_t g0 = 0; g0 < job->N; g0 += job->group_rows) {
        int64_t g1 = g0 + job->group_rows < job->N ? g0 + job->group_rows : job->N;
        for (int64_t c0 = v_begin; c0 < v_end; c0 += job->chunk_rows) {
            int64_t c1 = c0 + job->chunk_rows < v_end ? c0 + job->chunk_rows : v_end;
            for (int64_t t0 = g0; t0 < g1; t0 += 32) {
                const uint32_t *yp0 = job->yp + (t0 / 16) * KB * 256;
                const uint32_t *yp1 = yp0 + KB * 256;
                lanes_t s0, s1;
                load_lanes(job, seg, t0, &s0);
                load_lanes(job, seg, t0 + 16, &s1);
                for (int64_t v0 = c0; v0 < c1; v0 += 32) {
                    int rows = c1 - v0 < 32 ? (int)(c1 - v0) : 32;
                    const uint16_t *w = job->w + v0 * ldw;
                    int64_t ld = ldw;
                    if (rows < 32) { /* the last rows of W: a zero-padded copy, never a read past W */
                        memset(tail_w, 0, 32 * H * 2);
                        for (int i = 0; i < rows; i++) memcpy(tail_w + i * H, w + i * ldw, H * 2);
                        w = tail_w;
                        ld = H;
                    }
                    block(job->use_amx, w, ld, yp0, yp1, KB, c);
                    int64_t left = job->N - t0;
                    epilogue(job, c, rows, v0, t0, left < 16 ? (int)left : 16, &s0);
                    if (left > 16) epilogue(job, c + 16, rows, v0, t0 + 16, left < 32 ? (int)left - 16 : 16, &s1);
                }
                store_lanes(job, seg, t0, &s0);
                store_lanes(job, seg, t0 + 16, &s1);
            }
        }
    }
}

static AMX void *worker(void *arg) {
    job_t *job = (job_t *)arg;
    if (job->use_amx) tiles_on();
    uint16_t *tail_w = aligned_alloc(64, (size_t)(32 * job->H * 2 + 64) / 64 * 64);
    float *c = aligned_alloc(64, 32 * 32 * 4);
    while (tail_w && c) { /* a thread without scratch takes no segment: the others walk them */
        int64_t seg = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (seg >= job->nseg) break;
        run_segment(job, seg, tail_w, c);
        __atomic_fetch_add(&job->done, 1, __ATOMIC_RELAXED);
    }
    free(tail_w);
    free(c);
    if (job->use_amx) _tile_release();
    return NULL;
}

/* fn(job) on nthreads threads, this one among them; each takes work from the job until none is
   left, so a thread that cannot start changes no result. Returns 0, or -1 when one could not. */
static int run_threads(void *(*fn)(void *), void *job, int nthreads) {
    pthread_t *th = nthreads > 1 ? calloc(nthreads, sizeof *th) : NULL;
    int rc = nthreads > 1 && !th ? -1 : 0, started = 0;
    for (int i = 1; th && i < nthreads; i++) {
        if (pthread_create(&th[i], NULL, fn, job)) {
            rc = -1;
            break;
        }
        started = i;
    }
    fn(job);
    for (int i = 1; i <= started; i++) pthread_join(th[i], NULL);
    free(th);
    return rc;
}

/* The walk (see the header). best/dmax/arg/dsum (and asum, or NULL without the full lse):
   [nseg, Npad] (Npad = N rounded up to 32), set up by the caller (best, dmax -inf; arg 0;
   sums 0). logits (or NULL): [N, ld_logits] fp32, where the walk stores each token's draft
   logits in draft order as it meets them (`ef_draft_fix` turns them into log-probs). Returns 0;
   -1 when a thread could not start (the others did its work: the same result); -2 when memory
   ran out and the walk is incomplete. */
int ef_draft_argmax(const uint16_t *w, int64_t ldw, int64_t V, int64_t H, const uint32_t *yp, int64_t N,
                    const int64_t *draft_ids, int64_t Vd, int64_t seg_rows,
                    int64_t chunk_rows, int64_t group_rows, float *best, int32_t *arg, float *dmax,
                    double *dsum, double *asum, float *logits, int64_t ld_logits, int nthreads, int use_amx) {
    int64_t nblk = (V + 31) / 32;
    uint32_t *dmask = calloc(nblk, sizeof *dmask);
    int32_t *dpos = calloc(nblk, sizeof *dpos);
    if (!dmask || !dpos) {
        free(dmask);
        free(dpos);
        return -2;
    }
    for (int64_t d = 0; d < Vd; d++) dmask[draft_ids[d] / 32] |= 1u << (draft_ids[d] % 32);
    for (int64_t b = 1; b < nblk; b++) dpos[b] = dpos[b - 1] + __builtin_popcount(dmask[b - 1]);
    job_t job = {w, ldw, V, H, yp, N, dmask, seg_rows, (V + seg_rows - 1) / seg_rows,
                 chunk_rows, group_rows, best, dmax, arg, dsum, asum, logits, ld_logits, dpos, use_amx, 0, 0};
    int rc = run_threads(worker, &job, nthreads < 1 ? 1 : nthreads > job.nseg ? (int)job.nseg : nthreads);
    free(dmask);
    free(dpos);
    return job.done < job.nseg ? -2 : rc;
}

typedef struct {
    const uint16_t *y; /* [N, H] bf16, row stride ldy */
    int64_t ldy, N, H;
    const uint32_t *wdp; /* the draft rows of W, packed by ef_pack_y, zero up to a multiple of 32 */
    int64_t Vd;
    const float *lse; /* [N]: the draft logsumexp */
    void *out;        /* [N, Vd] fp32 or bf16, row stride ld_out */
    int64_t ld_out;
    int out_bf16;
    int64_t chunk_cols, nchunk;
    int use_amx;
    int next, done; /* as job_t's */
} out_job_t;

/* One chunk of draft columns [d0, d1) for every token: C = y W_d^T (`block`: A = y's rows, b =
   two 16-column halves of W_d), then x - lse, rounded, stored. */
static AMX void out_chunk(const out_job_t *j, int64_t d0, int64_t d1, uint16_t *tail_y, float *c) {
    const int64_t H = j->H, KB = H / 32;
    for (int64_t t0 = 0; t0 < j->N; t0 += 32) {
        int64_t nt = j->N - t0 < 32 ? j->N - t0 : 32;
        const uint16_t *a = j->y + t0 * j->ldy;
        int64_t lda = j->ldy;
        if (nt < 32) { /* the last tokens: a zero-padded copy, never a read past y */
            memset(tail_y, 0, 32 * H * 2);
            for (int64_t t = 0; t < nt; t++) memcpy(tail_y + t * H, a + t * j->ldy, H * 2);
            a = tail_y;
            lda = H;
        }
        for (int64_t c0 = d0; c0 < d1; c0 += 32) {
            const uint32_t *b0 = j->wdp + (c0 / 16) * KB * 256, *b1 = b0 + KB * 256;
            block(j->use_amx, a, lda, b0, b1, KB, c);
            int64_t nc = d1 - c0 < 32 ? d1 - c0 : 32;
            __mmask16 k0 = nc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1u);
            __mmask16 k1 = nc >= 32 ? (__mmask16)0xFFFF : nc > 16 ? (__mmask16)((1u << (nc - 16)) - 1u) : 0;
            for (int64_t t = 0; t < nt; t++) {
                __m512 l = _mm512_set1_ps(j->lse[t0 + t]);
                __m512 x0 = _mm512_sub_ps(_mm512_loadu_ps(c + 32 * t), l);
                __m512 x1 = _mm512_sub_ps(_mm512_loadu_ps(c + 32 * t + 16), l);
                if (j->out_bf16) {
                    uint16_t *o = (uint16_t *)j->out + (t0 + t) * j->ld_out + c0;
                    _mm256_mask_storeu_epi16(o, k0, (__m256i)_mm512_cvtneps_pbh(x0));
                    if (k1) _mm256_mask_storeu_epi16(o + 16, k1, (__m256i)_mm512_cvtneps_pbh(x1));
                } else {
                    float *o = (float *)j->out + (t0 + t) * j->ld_out + c0;
                    _mm512_mask_storeu_ps(o, k0, x0);
                    if (k1) _mm512_mask_storeu_ps(o + 16, k1, x1);
                }
            }
        }
    }
}

static AMX void *out_worker(void *arg) {
    out_job_t *j = (out_job_t *)arg;
    if (j->use_amx) tiles_on();
    uint16_t *tail_y = aligned_alloc(64, (size_t)(32 * j->H * 2 + 64) / 64 * 64);
    float *c = aligned_alloc(64, 32 * 32 * 4);
    while (tail_y && c) {
        int64_t q = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (q >= j->nchunk) break;
        int64_t d0 = q * j->chunk_cols, d1 = d0 + j->chunk_cols < j->Vd ? d0 + j->chunk_cols : j->Vd;
        out_chunk(j, d0, d1, tail_y, c);
        __atomic_fetch_add(&j->done, 1, __ATOMIC_RELAXED);
    }
    free(tail_y);
    free(c);
    if (j->use_amx) _tile_release();
    return NULL;
}

/* Pass 2 (see the header): out = the draft logits minus lse, chunks of chunk_cols columns (a
   multiple of 32) shared out among nthreads threads. Returns as ef_draft_argmax. */
int ef_draft_out(const uint16_t *y, int64_t ldy, int64_t N, int64_t H, const uint32_t *wdp, int64_t Vd,
                 const float *lse, void *out, int64_t ld_out, int out_bf16, int64_t chunk_cols, int nthreads,
                 int use_amx) {
    out_job_t job = {y, ldy, N, H, wdp, Vd, lse, out, ld_out, out_bf16, chunk_cols,
                     (Vd + chunk_cols - 1) / chunk_cols, use_amx, 0, 0};
    int rc = run_threads(out_worker, &job, nthreads < 1 ? 1 : nthreads > job.nchunk ? (int)job.nchunk : nthreads);
    return job.done < job.nchunk ? -2 : rc;
}

typedef struct {
    const float *src; /* [N, ld_src]: pass 1's draft logits */
    int64_t ld_src, N, Vd;
    const float *lse; /* [N] */
    void *out;        /* [N, ld_out] fp32 (may be src itself) or bf16 */
    int64_t ld_out;
    int out_bf16;
    int next;
} fix_job_t;

#define FIX_ROWS 16
static AVX512 void *fix_worker(void *arg) {
    fix_job_t *j = (fix_job_t *)arg;
    for (;;) {
        int64_t r0 = (int64_t)__atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED) * FIX_ROWS;
        if (r0 >= j->N) break;
        int64_t r1 = r0 + FIX_ROWS < j->N ? r0 + FIX_ROWS : j->N;
        for (int64_t t = r0; t < r1; t++) {
            const float *x = j->src + t * j->ld_src;
            __m512 l = _mm512_set1_ps(j->lse[t]);
            for (int64_t d = 0; d < j->Vd; d += 16) {
                __mmask16 k = j->Vd - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (j->Vd - d)) - 1u);
                __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + d), l);
                if (j->out_bf16)
                    _mm256_mask_storeu_epi16((uint16_t *)j->out + t * j->ld_out + d, k, (__m256i)_mm512_cvtneps_pbh(v));
                else
                    _mm512_mask_storeu_ps((float *)j->out + t * j->ld_out + d, k, v);
            }
        }
    }
    return NULL;
}

/* out[t, d] = src[t, d] - lse[t] rounded once to fp32 or bf16 (nearest-even), for N rows of Vd,
   FIX_ROWS rows at a time shared out among nthreads threads; out may be src (fp32). Returns as
   ef_draft_argmax (never -2). */
int ef_draft_fix(const float *src, int64_t ld_src, int64_t N, int64_t Vd, const float *lse, void *out,
                 int64_t ld_out, int out_bf16, int nthreads) {
    fix_job_t job = {src, ld_src, N, Vd, lse, out, ld_out, out_bf16, 0};
    int64_t blocks = (N + FIX_ROWS - 1) / FIX_ROWS;
    return run_threads(fix_worker, &job, nthreads < 1 ? 1 : nthreads > blocks ? (int)blocks : nthreads);
}

typedef struct {
    char *begin; /* page-aligned */
    int64_t bytes, piece;
    int next;
} populate_job_t;

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static void *populate_worker(void *arg) {
    populate_job_t *j = (populate_job_t *)arg;
    for (;;) {
        int64_t off = (int64_t)__atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED) * j->piece;
        if (off >= j->bytes) break;
        int64_t n = j->bytes - off < j->piece ? j->bytes - off : j->piece;
        if (madvise(j->begin + off, (size_t)n, MADV_POPULATE_WRITE)) /* before Linux 5.14: touch each page */
            for (int64_t p = 0; p < n; p += 4096) j->begin[off + p] = 0;
    }
    return NULL;
}

/* Fault in the pages of [ptr, ptr + bytes) for writing, on nthreads threads, 8 MiB at a time:
   a fresh output's pages taken in one pass rather than one fault at a time inside the walk.
   The bytes in the range are unspecified afterwards. Returns as ef_draft_fix. */
int ef_populate(void *ptr, int64_t bytes, int nthreads) {
    uintptr_t b = ((uintptr_t)ptr + 4095) / 4096 * 4096, e = ((uintptr_t)ptr + (uintptr_t)bytes) / 4096 * 4096;
    if (e <= b) return 0;
    populate_job_t job = {(char *)b, (int64_t)(e - b), 8 << 20, 0};
    int64_t pieces = (job.bytes + job.piece - 1) / job.piece;
    return run_threads(populate_worker, &job, nthreads < 1 ? 1 : nthreads > pieces ? (int)pieces : nthreads);
}
