/* Native CPU kernels for the Llama forward pass (mcpd/kernels/native.py builds and loads them).

Why native code: a decode step at batch 1 must stream every weight once, and torch's one-row
matrix-vector products stream a float32 LM head at a fraction of the machine's bandwidth
(bfloat16 ones far worse), while each of the dozens of small torch ops of a layer costs
microseconds of dispatch. These kernels read weights in nn.Linear's own [out, in] layout at the memory's pace
and fuse what torch runs as several ops: residual add + RMSNorm, rotary + KV-cache write, SiLU x
up, and attention of one query per sequence reading the paged KV cache in place.

Numerics follow transformers op by op: float32 accumulation, and in bfloat16 models a rounding to
bfloat16 wherever transformers rounds (after each matmul, add, norm step, rotary product), so
greedy tokens match it. Only summation order differs.

Portable C: GCC vector extensions of the CPU's own width, LANES floats: 16 (a zmm register)
where it has AVX-512F, else 8 (ymm: AVX2 and FMA); native.py builds a library of each width the
CPU runs. Wider vectors than the hardware's are no shortcut: GCC keeps them in memory, five
times slower. The avx512_bf16 dot-product instruction is used when the CPU has it. Threads come from OpenMP, the
same runtime (libgomp.so.1) torch loaded, so torch.set_num_threads() governs both.

dtype codes: 0 = float32, 1 = bfloat16 (stored as uint16).

Panels and tiles of each instruction set (a new weight format reuses them):
  weights     panels of 16 output rows (PANEL), the same bytes for every set (NativeKernels.form):
              float32 [n/16][k][16], bfloat16 and int8 [n/16][k/2][16][2], int8 scales
              [n/16][groups][16]; 4-bit bytes [n/16][k/32][4][16][4], their float16 scales and
              mins [n/16][k/32][16] (Q4_K: uint8, and float16 supers [n/16][k/256][2][16];
              Q6_K: int8 scales [n/16][k/16][16], highs [n/16][k/32][2][16][4], supers
              [n/16][k/256][1][16]) (mcpd_matrix). A panel's row of 16 is 1 vector (AVX-512)
              or 2 (AVX2).
  AVX-512F    LANES 16, 32 zmm registers: product tile 8 rows x 2 panels (8x32, 16 accumulators),
              int8 and 4-bit ones by int16 x (vpdpwssd where AVX512_VNNI is; 4-bit: 4 rows at a time); one
              row: 4 panels at once; prefill attention 8 query rows x 32 keys.
  AMX         the AVX-512 set, with every bfloat16 product whose k is a multiple of 32 on AMX
              tiles: 16 rows x 2 panels at a time, the panels read as they are (MCPD_AMX).
  AVX2 + FMA  LANES 8, 16 ymm registers: product tile 6 rows x 1 panel (6x16, 12 accumulators),
              int8 and 4-bit ones by int16 x (vpmaddwd, no VNNI; 4-bit: 4 rows at a time); one
              row: 4 panels at once; prefill attention 6 query rows x 16 keys.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define LANES 16
#define ACC_VECTORS 12        /* attention's value sums kept in registers at once (of 32) */
#else
#define LANES 8
#define ACC_VECTORS 6         /* of 16 */
#endif
typedef float f32v __attribute__((vector_size(4 * LANES)));
typedef int32_t i32v __attribute__((vector_size(4 * LANES)));
typedef uint32_t u32v __attribute__((vector_size(4 * LANES)));
typedef uint16_t u16v __attribute__((vector_size(2 * LANES)));
typedef uint16_t bf16;

enum { F32 = 0, BF16 = 1 };
#define MAX_HEAD_DIM 256
#define MAX_GROUP 16          /* query heads per KV head */
#define ATTN_CHUNK 64         /* keys scored at a time (online softmax) */

/* ---- vectors ------------------------------------------------------------------------------ */

static inline f32v load_f32(const float *p) { f32v v; memcpy(&v, p, sizeof v); return v; }
static inline void store_f32(float *p, f32v v) { memcpy(p, &v, sizeof v); }
static inline f32v splat(float x) { return (f32v){0} + x; }

static inline f32v load_bf16(const bf16 *p) {
    u16v h;
    memcpy(&h, p, sizeof h);
    u32v w = __builtin_convertvector(h, u32v) << 16;
    f32v f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* float32 -> bfloat16, round to nearest even, NaN kept a quiet NaN: c10::BFloat16's rounding. */
static inline u16v to_bf16(f32v f) {
    u32v u;
    memcpy(&u, &f, sizeof u);
    u32v rounded = (u + (((u >> 16) & 1) + 0x7fff)) >> 16;
    u32v nan = (u32v)(f != f);
    return __builtin_convertvector((rounded & ~nan) | (0x7fc0 & nan), u16v);
}

static inline void store_bf16(bf16 *p, f32v v) { u16v h = to_bf16(v); memcpy(p, &h, sizeof h); }

static inline f32v round_bf16(f32v f) {
    u32v w = __builtin_convertvector(to_bf16(f), u32v) << 16;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float bf16_to_f32(bf16 h) { uint32_t w = (uint32_t)h << 16; float f; memcpy(&f, &w, 4); return f; }

static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (bf16)((u + (((u >> 16) & 1) + 0x7fff)) >> 16);
}

/* Load LANES values of a row of either dtype as float32; store back, rounding when bfloat16. */
static inline f32v load_any(int dtype, const void *p, int64_t i) {
    return dtype == F32 ? load_f32((const float *)p + i) : load_bf16((const bf16 *)p + i);
}
static inline void store_any(int dtype, void *p, int64_t i, f32v v) {
    if (dtype == F32) store_f32((float *)p + i, v); else store_bf16((bf16 *)p + i, v);
}
/* What the model dtype makes of a float32 result: itself, or its bfloat16 rounding. */
static inline f32v in_dtype(int dtype, f32v v) { return dtype == F32 ? v : round_bf16(v); }

/* a where mask, else b (mask lanes all ones or all zeros, as vector comparisons give them) */
static inline f32v where(i32v mask, f32v a, f32v b) {
    return (f32v)(((i32v)a & mask) | ((i32v)b & ~mask));
}

/* Each kernel's body is written once for both dtypes and called with the dtype as a constant,
   so that the compiler makes a float32 and a bfloat16 copy with no dtype branch inside loops. */
#define INLINE static inline __attribute__((always_inline))
#define BY_DTYPE(body, ...) \
    do { if (dtype == F32) body(F32, __VA_ARGS__); else body(BF16, __VA_ARGS__); } while (0)

static inline f32v vmax(f32v a, f32v b) { return where(a > b, a, b); }

/* A vector's lanes combined by op (+ or vmax), halving: each lane with the one 8, 4, 2, 1 away. */
#if LANES == 16
#define REDUCE(op, v)                                                                                  \
    f32v a = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));   \
    a = op(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));        \
    a = op(a, __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));        \
    a = op(a, __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));        \
    return a[0]
#else
#define REDUCE(op, v)                                                          \
    f32v a = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));     \
    a = op(a, __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5));          \
    a = op(a, __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6));          \
    return a[0]
#endif
static inline f32v vadd(f32v a, f32v b) { return a + b; }
static inline float hsum(f32v v) { REDUCE(vadd, v); }
static inline float hmax(f32v v) { REDUCE(vmax, v); }
#undef REDUCE

/* exp(x), Cephes' polynomial (about 1 ulp); exp of -inf and of anything below -87.3 is 0. */
static inline f32v vexp(f32v x) {
    const f32v hi = splat(88.3762626647949f), lo = splat(-87.3365478515625f);
    i32v under = x < lo;
    x = where(x > hi, hi, x);
    x = where(under, lo, x);
    f32v fx = x * 1.44269504088896341f;
    fx = (fx + 12582912.0f) - 12582912.0f;           /* round to nearest integer */
    x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
    f32v y = splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    i32v scale = (__builtin_convertvector(fx, i32v) + 127) << 23;
    f32v pow2;
    memcpy(&pow2, &scale, sizeof pow2);
    y = y * pow2;
    return (f32v)((i32v)y & ~under);
}

/* ---- linear: y[m, n] = x[m, :] . w[n, :] (+ bias[n]) --------------------------------------- */

/* Weights are packed once, at load, into panels of 16 output rows (native.py packs them):
     float32:  [n/16][k][16]       panel p holds w[16p + j][i] at [p][i][j]
     bfloat16: [n/16][k/2][16][2]  pairs of consecutive i side by side, as vdpbf16ps takes them
   (n padded to a multiple of 16 with zero rows). A product then reads each panel as one
   sequential stream and multiplies it by one broadcast input value per step: no horizontal
   sums, and 16 multiply-adds per 64-byte load. A tile is two panels (32 outputs) by up to 8
   rows of x: 16 accumulators, 2 weight loads and 8 broadcasts per 16 multiply-adds, which keeps
   the FMA units busy (ahead of torch's GEMM at every row count here) and, at one row, reads
   weights as fast as a plain sum.
   AVX2 has 16 registers of 8 floats, a panel's 16 columns two of them: its tile is one panel by
   6 rows, 12 accumulators, 2 weight loads and a broadcast (the 6x16 of BLIS's Haswell kernel);
   the 8x2-panel tile's 32 accumulators would spill there. It keeps the FMA units as busy as
   oneDNN's AVX2 GEMM does; a 3-row x 2-panel tile is slower, and x repacked so that a tile's
   broadcasts read one stream no faster. The panels are the same for both. */
#ifdef __AVX512F__
#define TILE_ROWS 8
#define TILE_PANELS 2
#else
#define TILE_ROWS 6
#define TILE_PANELS 1
#endif
/* A tile fetches each panel's stream into L2 TILE_AHEAD cache lines (4 KB) ahead of its reads
   (past a panel's end: the next panel's start). At 8 rows a tile needs 128 bytes of weights per
   16 multiply-adds, about what one core streams, and without the fetches it runs well below its
   in-cache rate on weights from memory. Nearer fetches come too late and farther ones evict lines
   still to be read, on one thread and on two, float32 and bfloat16 alike. */
#define TILE_AHEAD 64
#define PANEL 16
#define VPP (PANEL / LANES)   /* vectors a panel's row of 16 takes: 1 (AVX-512) or 2 (AVX2) */

typedef f32v panel_sums[VPP];                        /* one row of x times one panel */
typedef panel_sums tile_sums[TILE_PANELS][TILE_ROWS];

static inline void zero_tile(tile_sums a) {
    for (int j = 0; j < TILE_PANELS; j++)
        for (int r = 0; r < TILE_ROWS; r++)
            for (int h = 0; h < VPP; h++) a[j][r][h] = splat(0);
}

INLINE void tile_f32(const float *x, int64_t rows, int64_t k, const float *const p[TILE_PANELS], tile_sums a) {
    zero_tile(a);
    for (int64_t i = 0; i < k; i++) {
        f32v w[TILE_PANELS][VPP];
        for (int j = 0; j < TILE_PANELS; j++) {
            __builtin_prefetch(p[j] + (i + TILE_AHEAD) * PANEL, 0, 2);
            for (int h = 0; h < VPP; h++) w[j][h] = load_f32(p[j] + i * PANEL + h * LANES);
        }
        for (int r = 0; r < rows; r++) {
            float xv = x[r * k + i];
            for (int j = 0; j < TILE_PANELS; j++)
                for (int h = 0; h < VPP; h++) a[j][r][h] += xv * w[j][h];
        }
    }
}

/* Without the bf16 dot product each pair of weights is widened in registers (they still stream
   at half float32's bytes), and x is read as float32, widened once by linear(): converting it
   here would cost two scalar conversions per four multiply-adds. */
#ifdef __AVX512BF16__
typedef bf16 bf16_x;    /* what a bfloat16 tile reads x as */
#else
typedef float bf16_x;
#endif
INLINE void tile_bf16(const bf16_x *x, int64_t rows, int64_t k, const bf16 *const p[TILE_PANELS], tile_sums a) {
#ifdef __AVX512BF16__
    __m512 c[TILE_PANELS][TILE_ROWS];
    for (int j = 0; j < TILE_PANELS; j++)
        for (int r = 0; r < TILE_ROWS; r++) c[j][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 2) {
        __m512bh w[TILE_PANELS];
        for (int j = 0; j < TILE_PANELS; j++) {
            __builtin_prefetch(p[j] + (i + 2 * TILE_AHEAD) * PANEL, 0, 2);
            w[j] = (__m512bh)_mm512_loadu_si512(p[j] + i * PANEL);
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * k + i, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < TILE_PANELS; j++) c[j][r] = _mm512_dpbf16_ps(c[j][r], w[j], xv);
        }
    }
    memcpy(a, c, sizeof c);
#else
    zero_tile(a);
    for (int64_t i = 0; i < k; i += 2) {   /* a 64-byte panel step: 16 pairs (w[i], w[i+1]) */
        f32v even[TILE_PANELS][VPP], odd[TILE_PANELS][VPP];
        for (int j = 0; j < TILE_PANELS; j++) {
            __builtin_prefetch(p[j] + (i + 2 * TILE_AHEAD) * PANEL, 0, 2);
            for (int h = 0; h < VPP; h++) {
                u32v u, e, o;
                memcpy(&u, p[j] + i * PANEL + 2 * h * LANES, sizeof u);
                e = u << 16, o = u & 0xffff0000u;
                memcpy(&even[j][h], &e, sizeof e);
                memcpy(&odd[j][h], &o, sizeof o);
            }
        }
        for (int r = 0; r < rows; r++) {
            float x0 = x[r * k + i], x1 = x[r * k + i + 1];
            for (int j = 0; j < TILE_PANELS; j++)
                for (int h = 0; h < VPP; h++) a[j][r][h] += x0 * even[j][h] + x1 * odd[j][h];
        }
    }
#endif
}

/* A weight matrix as the products read it (NativeKernels' Packed), of one of these kinds: panels
   of the model dtype; weight-only int8 (float32 scales, one per `group` columns); 4-bit (float16
   scales d, and for Q4_1 mins m, one per Q4_BLOCK columns; Q4_K: 6-bit scales and mins as
   bytes, and supers, each Q4K_SUPER columns' float16 d and dmin; Q6_K: int8 scales of 16
   columns, supers (d), and highs, each weight's top two bits). A matrix whose rows come in parts
   of different kinds (a fused q/k/v of a Q4_K_M file) is its first part, `rows` rows, and `next`,
   the rest: the products write each part's columns of y. */
enum { PLAIN = 0, INT8 = 1, Q4_0 = 2, Q4_1 = 3, Q4_K = 4, Q6_K = 5 };
typedef struct mcpd_matrix {
    const void *panels, *scales, *mins;   /* scales and mins NULL where the kind has none */
    int64_t kind, group;
    const void *supers, *highs;           /* Q4_K's and Q6_K's; NULL for the others */
    const struct mcpd_matrix *next;       /* the rows after this part's; NULL for a matrix of one kind */
    int64_t rows;                         /* this part's rows where next is not NULL */
} mcpd_matrix;

/* Weight-only int8 (mcpd/quant/int8.py) times int16 activations. Weights: panels
   [n/16][k/2][16][2] of int8, each output's consecutive inputs side by side (the pairs vpmaddwd
   multiplies), and float32 scales [n/16][groups][16], one per output row and `group` input
   columns (64 as mcpd quantizes, 32 as a GGUF Q8_0 block holds them). Activations: each row of x
   is quantized once per product to int16 with one float32 scale (x_int16_rows). A pair step
   sign-extends a panel row's 16 pairs to int16 once for all rows of the tile; each row multiplies
   them by its broadcast pair of activations and sums in int32 (vpmaddwd + vpaddd on AVX2, as
   Zen 2/3 have no VNNI; vpdpwssd where AVX512_VNNI exists). A group's integer sum is exact
   (|127 * 32767 * 64| < 2^31, groups past 64 columns summed in spans of 64) and scaled once in
   float32, the row's scale once at the end.
   Why: converting every weight to float32 (sign-extend, convert, multiply-add) bounds a
   decode step below what int8's reads allow; the pairs halve the
   instructions a weight. The activation rounding, about 2^-15 of a row's largest value, is far
   below the int8 weights' own (2^-8 of a group's largest); bench/quantized.py measures agreement
   with the float model. Integer sums do not depend on their order, so a row gets the same bits
   whatever rows share its tile (a one-token prompt batched gets the logits it gets alone). */
typedef int8_t i8v __attribute__((vector_size(LANES)));

/* LANES int8 as float32. GCC 12 turns __builtin_convertvector of int8 into scalar conversions
   (5x slower than float32 weights); AVX-512 and AVX2 have it as two instructions. */
static inline f32v load_int8(const int8_t *p) {
#ifdef __AVX512F__
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    i8v q;
    memcpy(&q, p, sizeof q);
    f32v f = __builtin_convertvector(q, f32v);
#endif
    f32v v;
    memcpy(&v, &f, sizeof v);
    return v;
}

static inline float x_at(int dtype, const void *x, int64_t i) {
    return dtype == F32 ? ((const float *)x)[i] : bf16_to_f32(((const bf16 *)x)[i]);
}

/* The end of the group of `group` columns that starts at column g0. */
static inline int64_t group_end(int64_t g0, int64_t k, int64_t group) {
    return k - g0 < group ? k : g0 + group;
}

#define INT16_LEVELS 32767
#define EXACT_COLUMNS 64   /* columns whose int8 x int16 products an int32 sums exactly */

/* LANES floats rounded to the nearest integer, ties to even (torch.round's rule). */
static inline i32v round_to_i32(f32v v) {
#ifdef __AVX512F__
    return (i32v)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX2__)
    return (i32v)_mm256_cvtps_epi32((__m256)v);
#else
    i32v r;
    for (int l = 0; l < LANES; l++) r[l] = (int32_t)lrintf(v[l]);
    return r;
#endif
}

/* |v|'s bits, compared as integers: they order as |v| does and put a NaN above an infinity above
   every finite value, so that a row's or a block's largest is found a vector at a time (compared
   lane by lane as floats, it would take most of a one-row product's quantizing on AVX2). */
static inline i32v abs_bits(f32v v) { return (i32v)v & 0x7fffffff; }
#ifdef __AVX512F__
static inline i32v max_i32(i32v a, i32v b) { return (i32v)_mm512_max_epi32((__m512i)a, (__m512i)b); }
static inline int32_t largest_lane(i32v v) { return _mm512_reduce_max_epi32((__m512i)v); }
static inline int32_t lanes_sum(i32v v) { return _mm512_reduce_add_epi32((__m512i)v); }
#elif defined(__AVX2__)
static inline i32v max_i32(i32v a, i32v b) { return (i32v)_mm256_max_epi32((__m256i)a, (__m256i)b); }
static inline int32_t largest_lane(i32v v) {   /* each lane with the one 4, 2, 1 away */
    __m256i m = _mm256_max_epi32((__m256i)v, _mm256_permute2x128_si256((__m256i)v, (__m256i)v, 1));
    m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0x4e));
    return _mm256_cvtsi256_si32(_mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0xb1)));
}
static inline int32_t lanes_sum(i32v v) {
    __m256i s = _mm256_add_epi32((__m256i)v, _mm256_permute2x128_si256((__m256i)v, (__m256i)v, 1));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4e));
    return _mm256_cvtsi256_si32(_mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xb1)));
}
#else
static inline i32v max_i32(i32v a, i32v b) { i32v more = a > b; return (a & more) | (b & ~more); }
static inline int32_t largest_lane(i32v v) {
    int32_t most = v[0];
    for (int l = 1; l < LANES; l++) most = v[l] > most ? v[l] : most;
    return most;
}
static inline int32_t lanes_sum(i32v v) {
    int32_t sum = 0;
    for (int l = 0; l < LANES; l++) sum += v[l];
    return sum;
}
#endif
static inline float from_bits(int32_t bits) { float f; memcpy(&f, &bits, sizeof f); return f; }

typedef int16_t i16v __attribute__((vector_size(2 * LANES)));
/* v's LANES int32, in the lane order `...`, stored at p as int16, each truncated (a NaN's INT_MIN as 0). */
#define STORE_I16(p, v, ...)                                                                          \
    do {                                                                                             \
        i16v stored_ = __builtin_convertvector(__builtin_shufflevector(v, v, __VA_ARGS__), i16v);     \
        memcpy(p, &stored_, sizeof stored_);                                                         \
    } while (0)
#if LANES == 16
#define IN_ORDER 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#define QUAD_ORDER 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15   /* each four columns as 0, 2, 1, 3 */
#else
#define IN_ORDER 0, 1, 2, 3, 4, 5, 6, 7
#define QUAD_ORDER 0, 2, 1, 3, 4, 6, 5, 7
#endif

/* Each row of x [m, k] (dtype) as int16, q = round(x * (32767 / max|x|)), into a new [m, k]
   buffer, and the row's scale max|x| / 32767 into scales[m] (a row of zeros: 0; a row with a
   NaN: NaN, so that its products are NaN, as float ones). int8.linear (the torch twin) rounds
   the same way. */
static int16_t *x_int16_rows(int dtype, const void *x, int64_t m, int64_t k, float *scales) {
    int16_t *q = malloc(m * k * sizeof(int16_t));
    for (int64_t r = 0; r < m; r++) {
        int64_t row = r * k, i = 0;
        i32v top = {0};
        for (; i + LANES <= k; i += LANES) top = max_i32(top, abs_bits(load_any(dtype, x, row + i)));
        float most = from_bits(largest_lane(top));
        for (; i < k; i++) {
            float a = fabsf(x_at(dtype, x, row + i));
            most = a > most || a != a ? a : most;
        }
        float inv = most > 0 ? INT16_LEVELS / most : 0;
        scales[r] = most / INT16_LEVELS;
        for (i = 0; i + LANES <= k; i += LANES) {
            i32v v = round_to_i32(load_any(dtype, x, row + i) * inv);
            STORE_I16(q + row + i, v, IN_ORDER);
        }
        for (; i < k; i++) q[row + i] = (int16_t)lrintf(x_at(dtype, x, row + i) * inv);
    }
    return q;
}

/* A panel row's LANES pairs of int8 weights (2 * LANES bytes) as int16, a pair a 32-bit lane. */
static inline i32v load_pairs(const int8_t *p) {
#if defined(__AVX512BW__)
    return (i32v)_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && !defined(__AVX512F__)
    return (i32v)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
#else
    int16_t w[2 * LANES];
    for (int l = 0; l < 2 * LANES; l++) w[l] = p[l];
    i32v v;
    memcpy(&v, w, sizeof v);
    return v;
#endif
}

/* acc + each lane's pair of int16 weights times the pair of int16 activations xs. */
static inline i32v madd_pairs(i32v acc, i32v w, i32v xs) {
#if defined(__AVX512VNNI__)
    return (i32v)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, (__m512i)xs);
#elif defined(__AVX512BW__)
    return acc + (i32v)_mm512_madd_epi16((__m512i)w, (__m512i)xs);
#elif defined(__AVX2__) && !defined(__AVX512F__)
    return acc + (i32v)_mm256_madd_epi16((__m256i)w, (__m256i)xs);
#else
    int16_t a[2 * LANES], b[2 * LANES];
    memcpy(a, &w, sizeof a);
    memcpy(b, &xs, sizeof b);
    for (int l = 0; l < LANES; l++) acc[l] += a[2 * l] * b[2 * l] + a[2 * l + 1] * b[2 * l + 1];
    return acc;
#endif
}

typedef i32v int8_sums[TILE_PANELS][VPP];   /* one row's int32 sums of a group */

/* One pair step (columns i, i + 1) of rows of x (int16) times the tile's panels, into s[r]; a line
   of each panel of the next strip fetched into L2 every four columns (`next`). */
INLINE void int8_pair_step(const int16_t *x, int64_t rows, int64_t k, int64_t i, const int8_t *const p[TILE_PANELS],
                           const int8_t *next, int8_sums s[]) {
    if (i % 4 == 0)
        for (int j = 0; j < TILE_PANELS; j++) __builtin_prefetch(next + i * TILE_PANELS * PANEL + 64 * j, 0, 2);
    i32v w[TILE_PANELS][VPP];
    for (int j = 0; j < TILE_PANELS; j++)
        for (int h = 0; h < VPP; h++) w[j][h] = load_pairs(p[j] + i * PANEL + h * 2 * LANES);
    for (int r = 0; r < rows; r++) {
        int32_t pair;
        memcpy(&pair, x + r * k + i, sizeof pair);
        i32v both = (i32v){0} + pair;
        for (int j = 0; j < TILE_PANELS; j++)
            for (int h = 0; h < VPP; h++) s[r][j][h] = madd_pairs(s[r][j][h], w[j][h], both);
    }
}

/* rows of x (int16, x_int16_rows' [rows, k], scales xs) times the tile's panels. The next
   strip's panels (the following TILE_PANELS * k * 16 bytes) are fetched into L2 while this one
   runs: a decode step is bound by reading the weights, and the hardware prefetcher ramps up too
   late on a panel's short stream. A lone row sums alternate pair steps in two chains, as
   vpdpwssd's latency (5 cycles) would otherwise bound it; integer sums, so the same bits. */
INLINE void tile_int8(const int16_t *x, const float *xs, int64_t rows, int64_t k, int64_t group,
                      const int8_t *const p[TILE_PANELS], const float *const c[TILE_PANELS], tile_sums a) {
    const int8_t *next = p[0] + TILE_PANELS * k * PANEL;
    zero_tile(a);
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        f32v scale[TILE_PANELS][VPP];
        for (int j = 0; j < TILE_PANELS; j++)
            for (int h = 0; h < VPP; h++) scale[j][h] = load_f32(c[j] + g0 / group * PANEL + h * LANES);
        int8_sums s[TILE_ROWS] = {{{{0}}}};
        int64_t i = g0, end = group_end(g0, k, group);
        if (rows == 1)
            for (; i + 4 <= end; i += 4) int8_pair_step(x, 1, k, i, p, next, s), int8_pair_step(x, 1, k, i + 2, p, next, s + 1);
        for (; i < end; i += 2) int8_pair_step(x, rows, k, i, p, next, s);
        for (int j = 0; j < TILE_PANELS && rows == 1; j++)
            for (int h = 0; h < VPP; h++) s[0][j][h] += s[1][j][h];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < TILE_PANELS; j++)
                for (int h = 0; h < VPP; h++) a[j][r][h] += __builtin_convertvector(s[r][j][h], f32v) * scale[j][h];
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < TILE_PANELS; j++)
            for (int h = 0; h < VPP; h++) a[j][r][h] *= xs[r];
}

/* 4-bit weights (GGUF's Q4_0 and Q4_1: mcpd/quant/int4.py): panels [n/16][k/32][4][16][4] of
   bytes, byte [p][b][t][r][u] holding row 16p + r's columns 32b + 4t + u (low nibble) and
   32b + 16 + 4t + u (high): a GGUF block's bytes, each row's four at a time side by side, so that
   a vector's 32-bit lane is one row's four columns (two vpmaddwd pairs: x_q16_quad);
   float16 scales d and (Q4_1) mins m [n/16][k/32][16]: w = d * q + m, Q4_0's m being -8 d.
   Q4_K (its nibbles put in this order at load): byte scales sc and mins mb [n/16][k/32][16], and
   float16 supers [n/16][k/256][2][16] (D, Dmin): d = D * sc and m = -Dmin * mb, both exact.
   Q6_K: the low nibbles so, highs [n/16][k/32][2][16][4] (byte [b][g][r][u]: row r's columns
   32b + 4g + u, + 8, + 16, + 24 at bits 0, 2, 4, 6), int8 scales [n/16][k/16][16] and supers D
   [n/16][k/256][1][16]: w = (D * scale) * (q - 32), each half block (16 columns) its own scale; the
   AVX2 set's values and highs, the same sizes, hold them otherwise (q6_pair_avx2). */
#define Q4_BLOCK 32
#define Q4_HALF (Q4_BLOCK / 2)
#define Q4K_SUPER 256
#define Q6_HIGH_BYTES 8   /* a block's highs, per row */
#define QUADS (Q4_HALF / 4)   /* a half block's groups of four columns */

/* LANES float16 as float32 (F16C; AVX-512F has it too). */
static inline f32v load_f16(const uint16_t *p) {
    f32v v;
#ifdef __AVX512F__
    __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&v, &f, sizeof v);
#elif defined(__F16C__)
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &f, sizeof v);
#else
    for (int i = 0; i < LANES; i++) v[i] = (float)((const _Float16 *)p)[i];
#endif
    return v;
}

/* LANES bytes widened to int32 (one instruction; GCC's generic conversion goes scalar). */
static inline i32v widen_u8(const uint8_t *p) {
    i32v v;
#ifdef __AVX512F__
    __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    memcpy(&v, &w, sizeof v);
#else
    for (int i = 0; i < LANES; i++) v[i] = p[i];
#endif
    return v;
}

/* LANES bytes as float32. */
static inline f32v load_u8(const uint8_t *p) { return __builtin_convertvector(widen_u8(p), f32v); }

/* Block b's scales (of its low and high halves: the same but for Q6_K) and mins of lanes h of a
   panel (d, m, s: its scales, mins and supers). */
INLINE void q4_scale_min(int kind, const void *d, const void *m, const uint16_t *s, int64_t b, int h,
                         f32v *scale, f32v *scale_hi, f32v *min) {
    int64_t at = b * PANEL + h * LANES;
    if (kind == Q6_K) {   /* two scales a block: [2b] and [2b + 1] */
        f32v super = load_f16(s + b / (Q4K_SUPER / Q4_BLOCK) * PANEL + h * LANES);
        const int8_t *halves = (const int8_t *)d + 2 * b * PANEL + h * LANES;
        *scale = super * load_int8(halves), *scale_hi = super * load_int8(halves + PANEL), *min = splat(0);
        return;
    }
    if (kind == Q4_K) {
        const uint16_t *super = s + b / (Q4K_SUPER / Q4_BLOCK) * 2 * PANEL + h * LANES;
        *scale = load_f16(super) * load_u8((const uint8_t *)d + at);
        *min = -(load_f16(super + PANEL) * load_u8((const uint8_t *)m + at));
    } else {
        *scale = load_f16((const uint16_t *)d + at);
        *min = kind == Q4_1 ? load_f16((const uint16_t *)m + at) : *scale * -8.0f;
    }
    *scale_hi = *scale;
}

/* The 4-bit products take x quantized once a product, each row in blocks of Q4_BLOCK columns, to
   int16 as x_int16_rows rounds a row (quant/activations_q16.py: q = round(x * (32767 / max |x|))), so
   that a block's weights and x meet as integers: a weight's nibble times q, two at a time into
   int32 lanes (vpmaddwd; vpdpwssd where AVX512_VNNI is), and one float multiply-add per block
   (d_w * d_x, Q4_K's sub-block scale, Q6_K's per-16 scale) instead of a conversion and a float
   multiply-add per weight, which would keep one row's product compute-bound. Not int8 x as
   llama.cpp takes it (vpmaddubsw / vpdpbusd, four a lane): int8 activations cost points of
   next-token agreement with the float model, enough to turn a greedy chat off its answer, where
   int16 keeps it nearly whole; nor do int8 blocks of 16, or int8 for the q/k/v and gate/up
   products alone, come near (bench/quantized.py measures agreement). The mins (and Q6_K's -32)
   need each half block's sum of q. */
typedef struct {
    const int16_t *q;       /* [m][k], each four columns as 0, 2, 1, 3: a lane's pairs */
    const float *d;         /* [m][k/32] */
    const int32_t *sums;    /* [m][k/16]: each half block's sum of q */
    const float *d_sums;    /* [m][k/32]: d times the block's sum of q, what its mins multiply: read by
                               AVX2's epilogue, short of vector slots; AVX-512's computes it in place */
} x_q16;

/* Block b of x (a row's 32 columns) into x_q16_quantize's buffers, a vector at a time: |x|'s bits
   compared as integers (abs_bits) put a NaN or an infinity above every finite value; such a
   block's inverse is 0, so each of its q converts to 0 (NaN -> INT_MIN, stored as the int16 0).
   Lane by lane, quantizing would take a noticeable share of a prefill's products, and on AVX2
   more than a narrow one-row product's weights. */
static inline void x_q16_block(int dtype, const void *x, int64_t b, int16_t *q, float *d, int32_t *sums,
                               float *d_sums) {
    enum { HALF_VECTORS = Q4_HALF / LANES };
    f32v v[2 * HALF_VECTORS];
    i32v top = {0};
    for (int i = 0; i < 2 * HALF_VECTORS; i++) {
        v[i] = load_any(dtype, x, b * Q4_BLOCK + i * LANES);
        top = max_i32(top, abs_bits(v[i]));
    }
    int32_t most = largest_lane(top);
    float amax = from_bits(most);
    int finite = most < 0x7f800000;
    float inverse = finite && amax > 0 ? INT16_LEVELS / amax : 0.0f;
    for (int h = 0; h < 2; h++) {
        i32v sum = {0};
        for (int i = 0; i < HALF_VECTORS; i++) {
            i32v r = round_to_i32(v[h * HALF_VECTORS + i] * inverse);
            r = (r << 16) >> 16;   /* the int16 it is stored as */
            sum += r;
            STORE_I16(q + b * Q4_BLOCK + h * Q4_HALF + i * LANES, r, QUAD_ORDER);
        }
        sums[2 * b + h] = lanes_sum(sum);
    }
    d[b] = finite ? amax / INT16_LEVELS : NAN;
    d_sums[b] = d[b] * (float)(sums[2 * b] + sums[2 * b + 1]);
}

/* x_q16 of x's m rows, in one allocation (free its q). A block holding a NaN or an infinity gets
   the scale NaN (and q 0), so that every output of its row is NaN, as the float product's is,
   not a block of steps measured from the rest. */
static x_q16 x_q16_quantize(int dtype, const void *x, int64_t m, int64_t k) {
    int64_t blocks = m * k / Q4_BLOCK;
    char *memory = malloc(m * k * sizeof(int16_t) + blocks * (2 * sizeof(float) + 2 * sizeof(int32_t)));
    int16_t *q = (int16_t *)memory;
    float *d = (float *)(q + m * k), *d_sums = d + blocks;
    int32_t *sums = (int32_t *)(d_sums + blocks);
    for (int64_t b = 0; b < blocks; b++) x_q16_block(dtype, x, b, q, d, sums, d_sums);
    return (x_q16){q, d, sums, d_sums};
}

/* The x_q16 of rows from `row` on. */
static inline x_q16 x_q16_rows(x_q16 all, int64_t row, int64_t k) {
    return (x_q16){all.q + row * k, all.d + row * (k / Q4_BLOCK), all.sums + row * (k / Q4_HALF),
                   all.d_sums + row * (k / Q4_BLOCK)};
}

typedef uint8_t u8v __attribute__((vector_size(4 * LANES)));    /* LANES rows' four columns of bytes */
typedef uint16_t u16x2v __attribute__((vector_size(4 * LANES)));   /* LANES rows' two columns */

/* acc + each lane's two int16 of w times the two int16 of x2, summed: vpdpwssd where the CPU
   has AVX512_VNNI, else vpmaddwd and an add. The AVX2 set never uses VNNI: AMD Zen 2 and 3
   lack it. w at most 63 and x 32767 in size: a block's 32 products sum within int32. */
static inline i32v x_q16_dot(i32v acc, u16x2v w, int32_t x2) {
    i32v out;
#if LANES == 16 && defined(__AVX512VNNI__)
    __m512i r = _mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x2));
    memcpy(&out, &r, sizeof out);
#elif LANES == 16 && defined(__AVX512BW__)
    __m512i r = _mm512_add_epi32((__m512i)acc, _mm512_madd_epi16((__m512i)w, _mm512_set1_epi32(x2)));
    memcpy(&out, &r, sizeof out);
#elif defined(__AVX2__)
    __m256i r = _mm256_add_epi32((__m256i)acc, _mm256_madd_epi16((__m256i)w, _mm256_set1_epi32(x2)));
    memcpy(&out, &r, sizeof out);
#else
    int16_t x[2];
    memcpy(x, &x2, sizeof x);
    out = acc;
    for (int l = 0; l < LANES; l++) out[l] += (int16_t)w[2 * l] * x[0] + (int16_t)w[2 * l + 1] * x[1];
#endif
    return out;
}

/* acc + a quad of bytes (each lane's four columns 0-3) times x's quad (stored 0, 2, 1, 3):
   columns 0 and 2 as the low bytes of each lane's two int16, 1 and 3 as the high ones. */
static inline i32v x_q16_quad(i32v acc, u8v w, const int16_t *x) {
    int32_t even, odd;
    memcpy(&even, x, sizeof even), memcpy(&odd, x + 2, sizeof odd);
    u16x2v pairs = (u16x2v)w;
    return x_q16_dot(x_q16_dot(acc, pairs & 0xff, even), pairs >> 8, odd);
}

static inline u8v load_u8v(const uint8_t *p) { u8v v; memcpy(&v, p, sizeof v); return v; }

/* Quad t of block b's low and high halves, lanes h, as unsigned bytes q: the nibbles, for Q6_K
   with their top two bits from hb, its highs (less 32 at the block's end, by x's sums). */
INLINE void q4_quads(int kind, const uint8_t *p, const void *hb, int64_t b, int t, int h, u8v *lo, u8v *hi) {
    u8v w = load_u8v(p + (b * Q4_HALF + 4 * t) * PANEL + h * 4 * LANES);
    *lo = w & 15, *hi = w >> 4;
    if (kind == Q6_K) {   /* quads 0, 1: bits 0-1 (low) and 4-5 (high) of highs' groups 0, 1; quads 2, 3: bits 2-3, 6-7 */
        int shift = 2 * (t / 2);
        u8v top = load_u8v((const uint8_t *)hb + (b * Q6_HIGH_BYTES + 4 * (t % 2)) * PANEL + h * 4 * LANES);
        *lo |= (top << (4 - shift)) & 0x30, *hi |= (top >> shift) & 0x30;
    }
}

/* Fetch into L2 block b's highs and scales of the next strip's Q6_K panels (those after the
   TILE_PANELS panels h and d point into), beside its weights (rows_int4's `next`): streams of
   their own, a third of a Q6_K panel's bytes, that the hardware prefetcher would find afresh at
   every strip. The other kinds' scales and mins, a tenth of their bytes, are left to it. */
INLINE void fetch_next_q6_sides(const void *d, const void *h, int64_t blocks, int64_t b) {
    for (int64_t j = TILE_PANELS; j < 2 * TILE_PANELS; j++) {
        __builtin_prefetch((const char *)d + (j * blocks + b) * PANEL * 2, 0, 2);   /* two int8 a row */
        for (int l = 0; l < Q6_HIGH_BYTES * PANEL / 64; l++)
            __builtin_prefetch((const char *)h + (j * blocks + b) * Q6_HIGH_BYTES * PANEL + 64 * l, 0, 2);
    }
}

/* Up to INT4_ROWS rows at a time multiply the 4-bit panels (rows_int4): each block's integer sums
   of a row in registers: on AVX-512 a whole tile (32 registers hold its sums, and its nibbles are
   unpacked once, not a pass per 4 rows). AVX2 has its own (rows_int4_avx2). */
#if LANES == 16
#define INT4_ROWS 8
#define Q6_K_ROWS 8
#else
#define INT4_ROWS 4   /* two sums a row (a panel row's two vectors), beside one column's nibbles of each */
#define Q6_K_ROWS 4   /* two sums a row (its halves' scales) */
#endif
_Static_assert(INT4_ROWS <= TILE_ROWS, "a 4-bit tile's sums are a tile_sums");

/* Rows of x (quantized: xq) by the strip's panels: per block, each row's integer sums of its
   low and high halves (one, but for Q6_K, whose halves have their own scales), then
   sum * (d_w * d_x) + m_w * (d_x * the block's sum of q): the nibbles of each block unpacked
   once for all the rows. A row's sums add the same terms in the same order whatever rows share
   its tile: a one-token prompt gets the logits it gets alone. The next strip's panels are
   fetched into L2 while this one runs, as tile_int8 does. */
INLINE void rows_int4(int kind, x_q16 xq, int64_t rows, int64_t k, const uint8_t *const p[TILE_PANELS],
                      const void *const d[TILE_PANELS], const void *const m[TILE_PANELS],
                      const uint16_t *const s[TILE_PANELS], tile_sums a) {
    const uint8_t *next = p[0] + TILE_PANELS * k / 2 * PANEL;
    int64_t blocks = k / Q4_BLOCK;
    const int hs = rows <= 2 ? VPP : 1;   /* a panel row's vectors a pass: all, or one past 2 rows */
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < TILE_PANELS; j++)
            for (int h = 0; h < VPP; h++) a[j][r][h] = splat(0);
    for (int h0 = 0; h0 < VPP; h0 += hs)
        for (int64_t b = 0; b < blocks; b++) {
            i32v lo_sum[INT4_ROWS][TILE_PANELS][VPP] = {{{0}}}, hi_sum[INT4_ROWS][TILE_PANELS][VPP] = {{{0}}};
            for (int l = 0; l < TILE_PANELS * Q4_HALF * PANEL / 64; l++)   /* the next strip's block b: as much as this one's */
                __builtin_prefetch(next + (b * TILE_PANELS * Q4_HALF * PANEL + 64 * l), 0, 2);
            if (kind == Q6_K && h0 == 0) fetch_next_q6_sides(d[0], m[0], blocks, b);
#pragma GCC unroll 4   /* each quad's Q6_K highs shift a constant */
            for (int t = 0; t < QUADS; t++)
                for (int j = 0; j < TILE_PANELS; j++)
                    for (int v = 0; v < hs; v++) {
                        u8v lo, hi;
                        q4_quads(kind, p[j], m[j], b, t, h0 + v, &lo, &hi);
                        for (int r = 0; r < rows; r++) {
                            const int16_t *xr = xq.q + r * k + b * Q4_BLOCK + 4 * t;
                            lo_sum[r][j][v] = x_q16_quad(lo_sum[r][j][v], lo, xr);
                            if (kind == Q6_K) hi_sum[r][j][v] = x_q16_quad(hi_sum[r][j][v], hi, xr + Q4_HALF);
                            else lo_sum[r][j][v] = x_q16_quad(lo_sum[r][j][v], hi, xr + Q4_HALF);
                        }
                    }
            for (int j = 0; j < TILE_PANELS; j++)
                for (int v = 0; v < hs; v++) {
                    f32v scale, scale_hi, min;
                    q4_scale_min(kind, d[j], m[j], s[j], b, h0 + v, &scale, &scale_hi, &min);
                    for (int r = 0; r < rows; r++) {
                        float dx = xq.d[r * blocks + b];
                        const int32_t *halves = xq.sums + r * 2 * blocks + 2 * b;
                        if (kind == Q6_K)
                            a[j][r][h0 + v] += __builtin_convertvector(lo_sum[r][j][v] - 32 * halves[0], f32v) * (scale * dx)
                                             + __builtin_convertvector(hi_sum[r][j][v] - 32 * halves[1], f32v) * (scale_hi * dx);
                        else
                            a[j][r][h0 + v] += __builtin_convertvector(lo_sum[r][j][v], f32v) * (scale * dx)
                                             + min * (dx * (float)(halves[0] + halves[1]));
                    }
                }
        }
}

#if LANES == 8 && defined(__AVX2__)
/* rows_int4 on AVX2: the same integer sums (each lane's terms in another order: the same bits),
   kept in 16 ymm registers. Past one row, Q6_K's two vectors of a panel row are a pass each over a
   block (its four lines stay in L1 for the second), so that Q6_K_ROWS rows' sums fit; the other
   kinds take both vectors in one pass, a column at a time (q4_quad_both_avx2). One read of the
   panel serves the tile's rows. A 16-bit half of a lane holds four nibbles: columns 0 and 16 of
   x_q16's pair in its low byte, 1 and 17 in its high one. For one row two masks and two shifts
   make int16 of them, columns 16 and 1 times 16 (w & 0xf0, (w >> 4) & 0xf0), summed apart and
   shifted back once a block: an operation a vector fewer than splitting bytes, and exact (a
   block's terms are at most 16 * 15 * 32767, 16 to a lane: far within int32). Q6_K is packed its own
   way for this set (q6_pair_avx2). Not float x times each panel dequantized once for all
   rows: an FMA makes 8 products where vpmaddwd makes 16, slower at every row count. */
static inline __m256i x_pair(const int16_t *x) {   /* two int16 of x in every lane */
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm256_set1_epi32(pair);
}

/* acc + w0 . x0 + w1 . x1 (vpmaddwd), the sum held in a register as it is: GCC otherwise regroups a
   block's additions into a tree whose partial sums outnumber the 16 registers (spilled). */
static inline __m256i madd2(__m256i acc, __m256i w0, const int16_t *x0, __m256i w1, const int16_t *x1) {
    acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(w0, x_pair(x0)), _mm256_madd_epi16(w1, x_pair(x1))));
    __asm__("" : "+x"(acc));
    return acc;
}

/* acc + w . x (vpmaddwd), held in a register as madd2's sum is. */
static inline __m256i madd1(__m256i acc, __m256i w, __m256i x) {
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
    __asm__("" : "+x"(acc));
    return acc;
}

/* Quads 2 pair and 2 pair + 1 of block b's Q6_K values, lanes v, into each row's low-half (lo) and
   high-half (hi) sums. This set's Q6_K arrangement (native_kernels.py, _six_bit_ends) puts whole 6-bit
   values at the ends of each 16-bit half of a lane, so that six of a pair's eight int16 vectors take one
   mask or one shift, not the three to five that joining a nibble to its top bits takes; columns 0 and 2
   of a quad are the others, times 64 (within int32: a pair sums four terms of at most 63 * 64 * 32767). */
INLINE void q6_pair_avx2(x_q16 xq, int64_t rows, int64_t k, const uint8_t *p, const uint8_t *hb, int64_t b,
                         int pair, int v, __m256i lo[INT4_ROWS], __m256i hi[INT4_ROWS]) {
    const __m256i six = _mm256_set1_epi16(0x003f), middle = _mm256_set1_epi16(0x03c0), top = _mm256_set1_epi16(0x0c00);
    int t = 2 * pair;
    __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + (b * Q4_HALF + 4 * t) * PANEL + v * 4 * LANES));
    __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + (b * Q4_HALF + 4 * t + 4) * PANEL + v * 4 * LANES));
    __m256i h = _mm256_loadu_si256((const __m256i *)(hb + (b * Q6_HIGH_BYTES + 4 * pair) * PANEL + v * 4 * LANES));
    __m256i odd0 = _mm256_and_si256(w0, six), odd1 = _mm256_and_si256(w1, six);                 /* columns 1, 3 of a quad, x64 below: 0, 2 */
    __m256i high_even0 = _mm256_srli_epi16(w0, 10), high_even1 = _mm256_srli_epi16(w1, 10);   /* 16, 18 */
    __m256i high_odd0 = _mm256_and_si256(h, six), high_odd1 = _mm256_srli_epi16(h, 10);       /* 17, 19 */
    __m256i even0 = _mm256_or_si256(_mm256_and_si256(w0, middle), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
    __m256i even1 = _mm256_or_si256(_mm256_and_si256(w1, middle), _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
    for (int r = 0; r < rows; r++) {
        const int16_t *x0 = xq.q + r * k + b * Q4_BLOCK + 4 * t, *x1 = x0 + 4;
        __m256i times64 = _mm256_add_epi32(_mm256_madd_epi16(even0, x_pair(x0)), _mm256_madd_epi16(even1, x_pair(x1)));
        lo[r] = madd2(_mm256_add_epi32(lo[r], _mm256_srai_epi32(times64, 6)), odd0, x0 + 2, odd1, x1 + 2);
        hi[r] = madd2(hi[r], high_even0, x0 + Q4_HALF, high_odd0, x0 + Q4_HALF + 2);
        hi[r] = madd2(hi[r], high_even1, x1 + Q4_HALF, high_odd1, x1 + Q4_HALF + 2);
    }
}

/* v as it is, in a register: GCC otherwise folds a loaded vector into each instruction that
   reads it, loading it again each time, and loads, two a cycle, bound the one-row loops. */
static inline void held(__m256i *v) { __asm__("" : "+x"(*v)); }

/* q6_pair_avx2 of one row, both vectors of the panel row at once (lo[v][0], hi[v][0]), an x pair
   at a time: each broadcast pair multiplies both vectors' values and is then dead, so that the
   sums, the masks and the loaded bytes fit in the 16 registers. */
INLINE void q6_pair_one_avx2(x_q16 xq, const uint8_t *p, const uint8_t *hb, int64_t b, int pair,
                             __m256i lo[VPP][INT4_ROWS], __m256i hi[VPP][INT4_ROWS]) {
    const __m256i six = _mm256_set1_epi16(0x003f), middle = _mm256_set1_epi16(0x03c0), top = _mm256_set1_epi16(0x0c00);
    const int16_t *x = xq.q + b * Q4_BLOCK + 8 * pair;
    const uint8_t *at = p + (b * Q4_HALF + 8 * pair) * PANEL, *high_at = hb + (b * Q6_HIGH_BYTES + 4 * pair) * PANEL;
    __m256i h[VPP], w[VPP], xx;
    for (int v = 0; v < VPP; v++) h[v] = _mm256_loadu_si256((const __m256i *)(high_at + v * 4 * LANES)), held(&h[v]);
    for (int q = 0; q < 2; q++, x += 4, at += 4 * PANEL) {   /* quads 2 pair + q */
        for (int v = 0; v < VPP; v++) w[v] = _mm256_loadu_si256((const __m256i *)(at + v * 4 * LANES)), held(&w[v]);
        xx = x_pair(x + 2);
        for (int v = 0; v < VPP; v++) lo[v][0] = madd1(lo[v][0], _mm256_and_si256(w[v], six), xx);
        xx = x_pair(x + Q4_HALF);
        for (int v = 0; v < VPP; v++) hi[v][0] = madd1(hi[v][0], _mm256_srli_epi16(w[v], 10), xx);
        xx = x_pair(x + Q4_HALF + 2);
        for (int v = 0; v < VPP; v++)
            hi[v][0] = madd1(hi[v][0], q ? _mm256_srli_epi16(h[v], 10) : _mm256_and_si256(h[v], six), xx);
        xx = x_pair(x);
        for (int v = 0; v < VPP; v++) {
            __m256i times64 = _mm256_or_si256(_mm256_and_si256(w[v], middle),
                                               _mm256_and_si256(_mm256_slli_epi16(h[v], 4 - 2 * q), top));
            lo[v][0] = _mm256_add_epi32(lo[v][0], _mm256_srai_epi32(_mm256_madd_epi16(times64, xx), 6));
            held(&lo[v][0]);
        }
    }
}

/* Quad t of block b's 4-bit values, lanes v, into one row's sums: of columns 0 and 17 (ones) and of
   16 and 1 times 16 (sixteens). */
INLINE void q4_quad_avx2(x_q16 xq, const uint8_t *p, int64_t b, int t, int v, __m256i *ones, __m256i *sixteens) {
    const __m256i low = _mm256_set1_epi16(0x000f), next = _mm256_set1_epi16(0x00f0);
    __m256i w = _mm256_loadu_si256((const __m256i *)(p + (b * Q4_HALF + 4 * t) * PANEL + v * 4 * LANES));
    __m256i col0 = _mm256_and_si256(w, low), col17 = _mm256_srli_epi16(w, 12);
    __m256i col16 = _mm256_and_si256(w, next), col1 = _mm256_and_si256(_mm256_srli_epi16(w, 4), next);
    const int16_t *x = xq.q + b * Q4_BLOCK + 4 * t;
    *ones = madd2(*ones, col0, x, col17, x + Q4_HALF + 2);
    *sixteens = madd2(*sixteens, col16, x + Q4_HALF, col1, x + 2);
}

/* Quad t of block b's 4-bit values, both of a panel row's vectors, into each row's sums (ones[v][r]):
   a column at a time, so that each pair of x, broadcast once, multiplies both vectors' nibbles (a
   pass a vector broadcast every pair twice: an instruction a multiply), and only the column's
   nibbles of the two vectors are held beside INT4_ROWS rows' two sums. */
INLINE void q4_quad_both_avx2(x_q16 xq, int64_t rows, int64_t k, const uint8_t *p, int64_t b, int t,
                              __m256i ones[VPP][INT4_ROWS]) {
    const __m256i low = _mm256_set1_epi16(0x000f);
    const uint8_t *at = p + (b * Q4_HALF + 4 * t) * PANEL;
    const int shifts[4] = {0, 12, 4, 8}, columns[4] = {0, Q4_HALF + 2, Q4_HALF, 2};   /* columns 0, 17, 16, 1 */
    for (int c = 0; c < 4; c++) {
        __m256i w[VPP];
        for (int v = 0; v < VPP; v++)
            w[v] = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(at + v * 4 * LANES)),
                                                      shifts[c]), low);
        for (int r = 0; r < rows; r++) {
            __m256i x = x_pair(xq.q + r * k + b * Q4_BLOCK + 4 * t + columns[c]);
            for (int v = 0; v < VPP; v++) ones[v][r] = madd1(ones[v][r], w[v], x);
        }
    }
}

/* rows_int4's product, AVX2's way (above). */
INLINE void rows_int4_avx2(int kind, x_q16 xq, int64_t rows, int64_t k, const uint8_t *const p[TILE_PANELS],
                           const void *const d[TILE_PANELS], const void *const m[TILE_PANELS],
                           const uint16_t *const s[TILE_PANELS], tile_sums a) {
    const uint8_t *next = p[0] + k / 2 * PANEL;
    int64_t blocks = k / Q4_BLOCK;
    const int paired = kind != Q6_K && rows > 1;   /* q4_quad_both_avx2's tile */
    const int together = rows == 1 || paired ? VPP : 1;   /* a panel row's vectors a pass: both, or one */
    /* One row's sums in registers (a tile's may alias the weights, bytes, so they stay in memory);
       past one row they would not fit beside the block sums. */
    panel_sums one[1], *sums = rows == 1 ? one : a[0];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < VPP; v++) sums[r][v] = splat(0);
    for (int64_t b = 0; b < blocks; b++) {
        for (int l = 0; l < Q4_HALF * PANEL / 64; l++)   /* the next strip's block b */
            __builtin_prefetch(next + b * Q4_HALF * PANEL + 64 * l, 0, 2);
        if (kind == Q6_K) fetch_next_q6_sides(d[0], m[0], blocks, b);
        for (int v0 = 0; v0 < VPP; v0 += together) {
            __m256i lo[VPP][INT4_ROWS], hi[VPP][INT4_ROWS];   /* Q6_K: its halves' sums; the others: ones, sixteens (one row's) */
            for (int v = 0; v < together; v++)
                for (int r = 0; r < rows; r++) lo[v][r] = hi[v][r] = _mm256_setzero_si256();
            if (kind == Q6_K)
#pragma GCC unroll 2
                for (int pair = 0; pair < QUADS / 2; pair++)
                    if (rows == 1) q6_pair_one_avx2(xq, p[0], m[0], b, pair, lo, hi);
                    else q6_pair_avx2(xq, rows, k, p[0], m[0], b, pair, v0, lo[0], hi[0]);
            else
#pragma GCC unroll 4
                for (int t = 0; t < QUADS; t++)
                    if (paired) q4_quad_both_avx2(xq, rows, k, p[0], b, t, lo);
                    else for (int v = 0; v < together; v++) q4_quad_avx2(xq, p[0], b, t, v0 + v, &lo[v][0], &hi[v][0]);
            for (int v = 0; v < together; v++) {
                f32v scale, scale_hi, min;
                q4_scale_min(kind, d[0], m[0], s[0], b, v0 + v, &scale, &scale_hi, &min);
                for (int r = 0; r < rows; r++) {
                    float dx = xq.d[r * blocks + b];
                    const int32_t *halves = xq.sums + r * 2 * blocks + 2 * b;
                    if (kind == Q6_K)
                        sums[r][v0 + v] += __builtin_convertvector((i32v)lo[v][r] - 32 * halves[0], f32v) * (scale * dx)
                                         + __builtin_convertvector((i32v)hi[v][r] - 32 * halves[1], f32v) * (scale_hi * dx);
                    else
                        sums[r][v0 + v] += __builtin_convertvector((i32v)lo[v][r] + ((i32v)hi[v][r] >> 4), f32v) * (scale * dx)
                                         + min * xq.d_sums[r * blocks + b];
                }
            }
        }
    }
    if (rows == 1) memcpy(a[0], one, sizeof one);
}
#define ROWS_INT4 rows_int4_avx2
#else
#define ROWS_INT4 rows_int4
#endif

/* rows_int4 of a count of rows and a kind known at compile time, so that its sums stay in
   registers and its loop tests no kind per weight. Not inlined: inside linear() it makes the
   plain tiles beside it slower (its own sums are local, so the call costs nothing per weight). */
static __attribute__((noinline)) void rows_int4_fixed(int kind, x_q16 xq, int64_t rows, int64_t k,
                                                      const uint8_t *const p[TILE_PANELS],
                                                      const void *const d[TILE_PANELS], const void *const m[TILE_PANELS],
                                                      const uint16_t *const s[TILE_PANELS], tile_sums a) {
#define ROWS(K, R) ROWS_INT4(K, xq, R, k, p, d, m, s, a)
#define BY_KIND(R) (kind == Q6_K ? ROWS(Q6_K, R) : kind == Q4_K ? ROWS(Q4_K, R) : kind == Q4_1 ? ROWS(Q4_1, R) : ROWS(Q4_0, R))
    switch (rows) {
    case 1: BY_KIND(1); break;
    case 2: BY_KIND(2); break;
    case 3: BY_KIND(3); break;
    case 4: BY_KIND(4); break;
#if INT4_ROWS > 4
    case 5: BY_KIND(5); break;
    case 6: BY_KIND(6); break;
#endif
#if INT4_ROWS > 6
    case 7: BY_KIND(7); break;
    case 8: BY_KIND(8); break;
#endif
    }
#undef BY_KIND
#undef ROWS
}

/* Store a tile's accumulators: + bias, rounded to dtype (or to dtype and back to float32 when
   y_f32: logits), for the columns below n, rows of y ld apart. */
static void store_tile(int dtype, int y_f32, void *y, int64_t n, int64_t ld, int64_t row0, int64_t rows, int64_t col0,
                       const panel_sums *acc, const void *bias) {
    int64_t cols = n - col0 < PANEL ? n - col0 : PANEL;
    float b[PANEL] = {0};
    if (bias)
        for (int64_t j = 0; j < cols; j++) b[j] = dtype == F32 ? ((const float *)bias)[col0 + j]
                                                              : bf16_to_f32(((const bf16 *)bias)[col0 + j]);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < VPP; h++) {   /* columns h * LANES ... of the panel */
            f32v v = acc[r][h] + load_f32(b + h * LANES);
            int64_t at = (row0 + r) * ld + col0 + h * LANES, left = cols - h * LANES;
            if (dtype == BF16) v = round_bf16(v);
            if (cols == PANEL && (dtype == F32 || y_f32)) store_f32((float *)y + at, v);
            else if (cols == PANEL) store_bf16((bf16 *)y + at, v);
            else
                for (int64_t j = 0; j < LANES && j < left; j++) {
                    if (dtype == F32 || y_f32) ((float *)y)[at + j] = v[j];
                    else ((bf16 *)y)[at + j] = f32_to_bf16(v[j]);
                }
        }
}

/* The tile with rows known at compile time for the usual counts, so that its sums stay in
   registers; on AVX2 every count (a small batch, a batch's last rows: 8 are 6 + 2), which speeds
   its small int8 products. On AVX-512 the same slows the 8-row tile. int8's groups of 64 (mcpd's)
   and 32 (GGUF's) are known at compile time too, so that a group's loop unrolls. All of it
   inlined into linear(): a tile's sums written through a pointer into a function not inlined may
   alias x and the weights (a vector type aliases its element type), so they would go to memory
   every step. */
#if TILE_ROWS == 6
#define SMALL_ROWS(TILE) else if (rows == 2) TILE(2); else if (rows == 3) TILE(3); \
                         else if (rows == 4) TILE(4); else if (rows == 5) TILE(5);
#else
#define SMALL_ROWS(TILE)
#endif
#define BY_ROWS(TILE) \
    do { if (rows == TILE_ROWS) TILE(TILE_ROWS); else if (rows == 1) TILE(1); SMALL_ROWS(TILE) else TILE(rows); } while (0)
INLINE void tile_plain(int dtype, const void *x, int64_t rows, int64_t k, const void *const p[TILE_PANELS],
                         tile_sums a) {
#define TILE(R) (dtype == F32 ? tile_f32((const float *)x, R, k, (const float *const *)p, a) \
                              : tile_bf16((const bf16_x *)x, R, k, (const bf16 *const *)p, a))
    BY_ROWS(TILE);
#undef TILE
}

/* tile_int8 of a count of rows and a group known at compile time (1 to TILE_ROWS; 64, mcpd's, or
   32, GGUF's), so that its integer sums stay in registers and a group's loop unrolls. Not
   inlined, as rows_int4_fixed: its sums are locals, written to the tile once a span. */
static __attribute__((noinline)) void tile_int8_fixed(const int16_t *x, const float *xs, int64_t rows, int64_t k,
                                                      int64_t group, const int8_t *const p[TILE_PANELS],
                                                      const float *const c[TILE_PANELS], tile_sums a) {
#define INT8(G, R) tile_int8(x, xs, R, k, G, p, c, a)
#define CASE(R) case R: group == 64 ? INT8(64, R) : group == 32 ? INT8(32, R) : INT8(group, R); break;
    switch (rows) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#if TILE_ROWS > 6
    CASE(7) CASE(8)
#endif
    }
#undef CASE
#undef INT8
}

/* p, c, mn, s: each panel's weights, scales, mins (Q6_K: highs) and supers (w's kind says which
   there are); xq: a 4-bit matrix's x_q16 of x's rows; an int8 one's x is x_int16_rows' and
   x_scales their scales. */
INLINE void tile(int dtype, const void *x, const float *x_scales, x_q16 xq, int64_t rows, int64_t k,
                 const mcpd_matrix *w, const void *const p[TILE_PANELS], const void *const c[TILE_PANELS],
                 const void *const mn[TILE_PANELS], const void *const s[TILE_PANELS], tile_sums a) {
    if (w->kind == PLAIN) tile_plain(dtype, x, rows, k, p, a);
    else if (w->kind == INT8)
        tile_int8_fixed(x, x_scales, rows, k, w->group, (const int8_t *const *)p, (const float *const *)c, a);
    else rows_int4_fixed(w->kind, xq, rows, k, (const uint8_t *const *)p, c, mn, (const uint16_t *const *)s, a);
}

/* The calling thread's index in its OpenMP team, and the team's size. */
static inline void team_place(int *thread, int *threads) {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    *thread = omp_get_thread_num(), *threads = omp_get_num_threads();
#else
    *thread = 0, *threads = 1;
#endif
}

/* One row of x (a decode step's product) by ROW_PANELS panels at once. Each output's sum is the
   tile's, term by term in the same order (so the same bits), but four independent multiply-add
   chains where the tile's one row has two: a chain waits out an FMA's latency per step, and
   with only two the loop cannot run far enough ahead of its loads to keep memory busy; eight
   are no better than four. bfloat16 where the CPU has its dot product (else the tile, which emulates it). */
#define ROW_PANELS 4

/* Each of the ROW_PANELS streams is fetched into L2 ROW_AHEAD cache lines (1.5 KB) ahead of its
   reads: the hardware prefetcher alone keeps fewer lines in flight than four streams need. Nearer
   does no better, farther and into L1 worse. */
#define ROW_AHEAD 24
/* Near its end a run's streams fetch the start of the next run's panels instead (`next`: how far
   on, in panel rows, its panels begin; 0 for none), so that a run does not begin with four cold
   streams, a gap of memory latency every run; the bits are the same. On fast memory each core
   streams at its own ceiling and a gap in one core's stream is not filled by the other's. Each
   thread's runs are one contiguous share (linear_row), so the next run is the thread's own but
   at the end of its share. */
INLINE int64_t ahead(int64_t i, int64_t rows, int64_t k, int64_t next) {   /* the panel row to fetch */
    return i + rows < k || !next ? i + rows : next + i + rows - k;
}

INLINE void row_f32(const float *x, int64_t k, const float *const q[ROW_PANELS], int64_t next,
                    panel_sums acc[ROW_PANELS]) {
    for (int j = 0; j < ROW_PANELS; j++)
        for (int h = 0; h < VPP; h++) acc[j][h] = splat(0);
    for (int64_t i = 0; i < k; i++) {
        float xv = x[i];
        for (int j = 0; j < ROW_PANELS; j++) __builtin_prefetch(q[j] + ahead(i, ROW_AHEAD, k, next) * PANEL, 0, 2);
        for (int j = 0; j < ROW_PANELS; j++)
            for (int h = 0; h < VPP; h++) acc[j][h] += xv * load_f32(q[j] + i * PANEL + h * LANES);
    }
}

#ifdef __AVX512BF16__
#define ROW_BF16 1
INLINE void row_bf16(const bf16 *x, int64_t k, const bf16 *const q[ROW_PANELS], int64_t next,
                     panel_sums acc[ROW_PANELS]) {
    __m512 c[ROW_PANELS];
    for (int j = 0; j < ROW_PANELS; j++) c[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 2) {
        int32_t pair;
        memcpy(&pair, x + i, sizeof pair);
        __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < ROW_PANELS; j++) __builtin_prefetch(q[j] + ahead(i, 2 * ROW_AHEAD, k, next) * PANEL, 0, 2);
        for (int j = 0; j < ROW_PANELS; j++)
            c[j] = _mm512_dpbf16_ps(c[j], (__m512bh)_mm512_loadu_si512(q[j] + i * PANEL), xv);
    }
    memcpy(acc, c, sizeof c);
}
#else
#define ROW_BF16 0
#endif

/* linear() for one row: runs of ROW_PANELS panels, each thread one contiguous share of them
   (row_runs does runs first_run .. end_run - 1; linear_row and the one-row stack share them out). A
   short last run reads its first panel again in place of the missing ones and drops their sums.
   Static shares, not runs handed out two at a time: each thread then streams one stretch of
   memory, and what `ahead` fetches is its own next run; on fast memory, where each core streams
   at its own ceiling, that is what brings a token near the read limit. Dynamic shares would
   suit a helper woken late; the whole stack is one native call, and its helper spins between
   products (threads.py, "brief"). Under a neighbour the thread tuner drops to one thread. */
static void row_runs(int dtype, const void *x, int64_t k, const void *packed, const void *bias, int64_t n, void *y,
                     int64_t ld, int y_f32, int64_t first_run, int64_t end_run) {
    size_t size = dtype == F32 ? 4 : 2;
    int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t run = first_run; run < end_run; run++) {
        int64_t first = run * ROW_PANELS, count = panels - first < ROW_PANELS ? panels - first : ROW_PANELS;
        const char *q[ROW_PANELS];
        for (int j = 0; j < ROW_PANELS; j++)
            q[j] = (const char *)packed + (first + (j < count ? j : 0)) * k * PANEL * size;
        int64_t next = run + 1 < end_run && count == ROW_PANELS ? ROW_PANELS * k : 0;
        panel_sums acc[ROW_PANELS];
#if ROW_BF16
        if (dtype == BF16) row_bf16((const bf16 *)x, k, (const bf16 *const *)q, next, acc);
        else
#endif
        row_f32((const float *)x, k, (const float *const *)q, next, acc);
        for (int64_t j = 0; j < count; j++) store_tile(dtype, y_f32, y, n, ld, 0, 1, (first + j) * PANEL, &acc[j], bias);
    }
}

/* Whether a one-row product by a matrix of this kind takes row_runs (else the tile, or AMX's). */
static inline int takes_amx(int dtype, const mcpd_matrix *w, int64_t k);
static inline int takes_row_runs(int dtype, const mcpd_matrix *w, int64_t k) {
    return w->kind == PLAIN && (dtype == F32 || ROW_BF16) && !takes_amx(dtype, w, k);
}

/* The first and end run (or strip) of `units` that thread `thread` of `threads` owns. */
static inline void contiguous_share(int64_t units, int thread, int threads, int64_t *first, int64_t *end) {
    int64_t share = (units + threads - 1) / threads;
    *first = thread * share < units ? thread * share : units;
    *end = *first + share < units ? *first + share : units;
}

static void linear_row(int dtype, const void *x, int64_t k, const void *packed, const void *bias, int64_t n,
                       void *y, int64_t ld, int y_f32) {
    int64_t runs = (n + PANEL * ROW_PANELS - 1) / (PANEL * ROW_PANELS);
    #pragma omp parallel if (runs > 1 && n * k >= 32768)
    {
        int thread, threads;
        int64_t first, end;
        team_place(&thread, &threads);
        contiguous_share(runs, thread, threads, &first, &end);
        row_runs(dtype, x, k, packed, bias, n, y, ld, y_f32, first, end);
    }
}

/* Bytes of one panel of w's weights, scales, mins (Q6_K: highs) and supers (a missing kind: 0). */
static void panel_bytes(int dtype, const mcpd_matrix *w, int64_t k, int64_t bytes[4]) {
    int64_t blocks = k / Q4_BLOCK, scale_size = w->kind == Q4_K ? 1 : 2;
    bytes[0] = w->kind == PLAIN ? k * PANEL * (dtype == F32 ? 4 : 2) : w->kind == INT8 ? k * PANEL : k / 2 * PANEL;
    bytes[1] = w->kind == PLAIN ? 0 : w->kind == INT8 ? (k + w->group - 1) / w->group * PANEL * 4
             : blocks * PANEL * scale_size;   /* Q6_K: two int8 a block */
    bytes[2] = w->kind == Q4_1 || w->kind == Q4_K ? blocks * PANEL * scale_size
             : w->kind == Q6_K ? blocks * Q6_HIGH_BYTES * PANEL : 0;
    bytes[3] = w->kind == Q4_K || w->kind == Q6_K ? k / Q4K_SUPER * (w->kind == Q4_K ? 2 : 1) * PANEL * 2 : 0;
}

int mcpd_max_threads(void);

/* How linear_part's threads split a product's strips: each owns one contiguous share, as even as
   the strips divide, and takes it from the front, so that it streams its share of the weights
   once and the next strip its tiles fetch is its own. A thread done with its share takes the
   other shares' strips from the back, STOLEN_STRIPS at a time: with fixed shares every product
   waits for its slowest thread, and beside a busy neighbour the thread that shares its core runs
   at about half speed while the other sits idle. An owner's and its thieves' claims meet in one
   word per share (front in the low half, end in the high half), so that a strip is taken once. */
#define STOLEN_STRIPS 1   /* a strip is microseconds of work: a thief that took more could leave the owner the wait */
#define MAX_SHARES 64
typedef struct {
    uint64_t range;     /* front | end << 32: the strips not yet taken */
} __attribute__((aligned(64))) strip_share;   /* a cache line each: one owner's claims do not stall another's */

static void split_strips(strip_share *shares, int count, int64_t strips) {
    for (int i = 0; i < count; i++) {
        uint64_t front = strips * i / count, end = strips * (i + 1) / count;
        shares[i].range = front | end << 32;
    }
}

/* Takes up to `most` strips of the share, from its front (the owner) or its back (a thief): sets
   *first to the first of them and returns how many (0: none left). */
static int64_t take_strips(strip_share *share, int from_back, uint64_t most, int64_t *first) {
    uint64_t range = __atomic_load_n(&share->range, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t front = range & 0xffffffffu, end = range >> 32;
        if (front >= end) return 0;
        uint64_t count = end - front < most ? end - front : most;
        uint64_t rest = from_back ? front | (end - count) << 32 : (front + count) | end << 32;
        if (__atomic_compare_exchange_n(&share->range, &range, rest, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *first = (int64_t)(from_back ? end - count : front);
            return (int64_t)count;
        }
    }
}

/* x of a product as its matrix's kind reads it: as given, widened (bfloat16 x of a plain matrix
   without the bf16 dot product: bf16_x), as int16 rows and their scales (int8), or quantized (4-bit:
   xq). Each thread of the one-row stack makes its own: the same values, and no wait for another. */
typedef struct {
    const void *x;
    size_t size;         /* bytes of an element of x */
    float *scales;       /* int8's: each row's x_int16_rows scale */
    x_q16 xq;
    void *owned;         /* the widened or int16 copy */
} product_x;

static product_x product_x_of(int dtype, const void *x, int64_t m, int64_t k, int kind) {
    product_x px = {x, dtype == F32 ? 4 : 2, NULL, {0}, NULL};
    if (dtype == BF16 && kind == PLAIN && sizeof(bf16_x) == sizeof(float)) {
        float *widened = malloc(m * k * sizeof(float));
        for (int64_t i = 0; i < m * k; i++) widened[i] = bf16_to_f32(((const bf16 *)x)[i]);
        px.x = px.owned = widened, px.size = sizeof(float);
    }
    if (kind >= Q4_0) px.xq = x_q16_quantize(dtype, x, m, k);
    if (kind == INT8) {
        px.scales = malloc(m * sizeof(float));
        px.x = px.owned = x_int16_rows(dtype, x, m, k, px.scales), px.size = sizeof(int16_t);
    }
    return px;
}

static void product_x_free(product_x px) {
    free(px.owned);
    free((void *)px.xq.q);
    free(px.scales);
}

#ifdef MCPD_AMX
/* bfloat16 products on AMX tiles (the native-amx set): a 16 x 32 tile of x's rows times a panel's
   16 pair rows of 64 bytes, which is the panels' own layout ([k/2][16][2]), into 16 x 16 float32
   sums. Its sums round otherwise than vdpbf16ps's, so in this set every bfloat16 product whose k
   the tiles divide takes them, one row included: a row's bits then do not depend on the rows
   beside it in a step. Tiles 0-2: sums of 16 rows by a strip's two panels, and their x; 3, 4: the
   panels' weights; 5-7: as 0-2 for a last block of fewer rows. Linux hands a process the tiles'
   state only once asked: native.py asks before it loads this set (native.tiles_granted). */
#define AMX_K 32   /* bfloat16 columns of a tile's row of 64 bytes */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* A thread loads the tiles' shapes once per exported call (amx_new_call) and tail: a load per
   strip cost a one-row decode step about a twentieth of its time, and between calls another
   library's tiles (oneDNN's, in torch) may have run on the thread. */
static int64_t amx_call;
static __thread int64_t amx_loaded_in = -1, amx_loaded_rows;

static inline void amx_new_call(void) { amx_call++; }

static void amx_configure(int64_t last_rows) {
    if (amx_loaded_in == amx_call && amx_loaded_rows == last_rows) return;
    amx_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = t < 5 ? 16 : (uint8_t)last_rows;
    _tile_loadconfig(&c);
    amx_loaded_in = amx_call, amx_loaded_rows = last_rows;
}

#define AMX_BLOCK(C0, C1, A, x, k, p0, p1)                                                            \
    do {                                                                                             \
        _tile_zero(C0);                                                                              \
        _tile_zero(C1);                                                                              \
        for (int64_t i = 0; i < (k); i += AMX_K) {                                                   \
            _tile_loadd(A, (x) + i, (k) * sizeof(bf16));                                             \
            _tile_loadd(3, (p0) + i * PANEL, 64);                                                    \
            _tile_loadd(4, (p1) + i * PANEL, 64);                                                    \
            _tile_dpbf16ps(C0, A, 3);                                                                \
            _tile_dpbf16ps(C1, A, 4);                                                                \
        }                                                                                            \
        _tile_stored(C0, sums[0], PANEL * sizeof(float));                                            \
        _tile_stored(C1, sums[1], PANEL * sizeof(float));                                            \
    } while (0)

static inline int takes_amx(int dtype, const mcpd_matrix *w, int64_t k) {
    return dtype == BF16 && w->kind == PLAIN && k % AMX_K == 0;
}

/* strip_product's bfloat16 strip on the tiles: x [m, k], its `count` panels p (2, the second
   the first again when the strip has one). */
static void amx_strip(const bf16 *x, int64_t m, int64_t k, const bf16 *const p[TILE_PANELS], int64_t count,
                      int64_t first, const void *bias, int64_t n, void *y, int64_t ld, int y_f32) {
    float sums[TILE_PANELS][16][PANEL] __attribute__((aligned(64)));
    amx_configure(m % 16 ? m % 16 : 16);
    for (int64_t row = 0; row < m; row += 16) {
        int64_t rows = m - row < 16 ? m - row : 16;
        const bf16 *xr = x + row * k;
        if (rows == 16) AMX_BLOCK(0, 1, 2, xr, k, p[0], p[1]);
        else AMX_BLOCK(5, 6, 7, xr, k, p[0], p[1]);
        for (int64_t j = 0; j < count; j++)
            store_tile(BF16, y_f32, y, n, ld, row, rows, (first + j) * PANEL, (const panel_sums *)sums[j], bias);
    }
}
#else
static inline int takes_amx(int dtype, const mcpd_matrix *w, int64_t k) { (void)dtype, (void)w, (void)k; return 0; }
static inline void amx_new_call(void) {}
#endif

/* Strip `strip` (a tile's TILE_PANELS panels) of x's m rows by w [n, k]: into y's columns of it. */
static void strip_product(int dtype, product_x px, int64_t m, int64_t k, const mcpd_matrix *w, const int64_t bytes[4],
                          int64_t strip, const void *bias, int64_t n, void *y, int64_t ld, int y_f32) {
    int64_t panels = (n + PANEL - 1) / PANEL, first = strip * TILE_PANELS;
    int64_t count = panels - first < TILE_PANELS ? panels - first : TILE_PANELS;
    const void *p[TILE_PANELS], *c[TILE_PANELS], *mn[TILE_PANELS], *s[TILE_PANELS];
    for (int j = 0; j < TILE_PANELS; j++) {   /* a missing panel: the first again, its sums dropped */
        int64_t panel = first + (j < count ? j : 0);
        p[j] = (const char *)w->panels + panel * bytes[0];
        c[j] = bytes[1] ? (const char *)w->scales + panel * bytes[1] : NULL;
        mn[j] = bytes[2] ? (const char *)(w->kind == Q6_K ? w->highs : w->mins) + panel * bytes[2] : NULL;
        s[j] = bytes[3] ? (const char *)w->supers + panel * bytes[3] : NULL;
    }
#ifdef MCPD_AMX
    if (takes_amx(dtype, w, k))
        return amx_strip((const bf16 *)px.x, m, k, (const bf16 *const *)p, count, first, bias, n, y, ld, y_f32);
#endif
    /* A 4-bit tile is as many rows as its sums' registers hold: it unpacks the strip's nibbles once for them all. */
    int64_t tile_rows = w->kind < Q4_0 ? TILE_ROWS : w->kind == Q6_K ? Q6_K_ROWS : INT4_ROWS;
    for (int64_t row = 0; row < m; row += tile_rows) {
        int64_t rows = m - row < tile_rows ? m - row : tile_rows;
        tile_sums a;
        tile(dtype, (const char *)px.x + row * k * px.size, px.scales ? px.scales + row : NULL,
             w->kind >= Q4_0 ? x_q16_rows(px.xq, row, k) : px.xq, rows, k, w, p, c, mn, s, a);
        for (int64_t j = 0; j < count; j++)
            store_tile(dtype, y_f32, y, n, ld, row, rows, (first + j) * PANEL, a[j], bias);
    }
}

/* The strips of linear_part this thread takes (split_strips): its own share's from the front,
   then the other shares' from the back. */
static void take_and_multiply(int dtype, product_x px, int64_t m, int64_t k, const mcpd_matrix *w,
                              const int64_t bytes[4], strip_share *shares, int count, const void *bias, int64_t n,
                              void *y, int64_t ld, int y_f32) {
    int thread, threads;
    team_place(&thread, &threads);
    int64_t first, taken;
    while (take_strips(&shares[thread], 0, 1, &first))
        strip_product(dtype, px, m, k, w, bytes, first, bias, n, y, ld, y_f32);
    for (int other = 1; other < count; other++)
        while ((taken = take_strips(&shares[(thread + other) % count], 1, STOLEN_STRIPS, &first)))
            for (int64_t strip = first; strip < first + taken; strip++)
                strip_product(dtype, px, m, k, w, bytes, strip, bias, n, y, ld, y_f32);
}

/* x: [m, k] of dtype, w: a matrix of [n, k] of one kind packed as above, bias: [n] or NULL; y:
   [m, n] of dtype, rows ld apart, or float32 holding dtype-rounded values when y_f32 (logits).
   Threads take the strips as split_strips says. */
static void linear_part(int dtype, const void *x, int64_t m, int64_t k, const mcpd_matrix *w, const void *bias,
                        int64_t n, void *y, int64_t ld, int y_f32) {
    int64_t panels = (n + PANEL - 1) / PANEL, strips = (panels + TILE_PANELS - 1) / TILE_PANELS, bytes[4];
    panel_bytes(dtype, w, k, bytes);
    if (m == 1 && takes_row_runs(dtype, w, k)) return linear_row(dtype, x, k, w->panels, bias, n, y, ld, y_f32);
    product_x px = product_x_of(dtype, x, m, k, w->kind);
    int count = mcpd_max_threads() < MAX_SHARES ? mcpd_max_threads() : MAX_SHARES;
    strip_share shares[count];
    split_strips(shares, count, strips);
    #pragma omp parallel num_threads(count) if (strips > 1 && n * k * m >= 32768)
    take_and_multiply(dtype, px, m, k, w, bytes, shares, count, bias, n, y, ld, y_f32);
    product_x_free(px);
}

/* linear_part of each of w's parts, into its columns of y [m, n] (and of the bias). */
static void linear(int dtype, const void *x, int64_t m, int64_t k, const mcpd_matrix *w, const void *bias,
                   int64_t n, void *y, int y_f32) {
    size_t size = dtype == F32 ? 4 : 2, y_size = y_f32 ? 4 : size;
    for (int64_t at = 0; w; w = w->next) {
        int64_t rows = w->next ? w->rows : n - at;
        linear_part(dtype, x, m, k, w, bias ? (const char *)bias + at * size : NULL, rows, (char *)y + at * y_size,
                    n, y_f32);
        at += rows;
    }
}

void mcpd_linear(int dtype, const void *x, int64_t m, int64_t k, const mcpd_matrix *w, const void *bias,
                 int64_t n, void *y, int y_f32) {
    amx_new_call();
    linear(dtype, x, m, k, w, bias, n, y, y_f32);
}

/* Where column c's byte of panel row j lies in a block's quads ([c / 4][j][c % 4]). */
static inline int64_t quad_byte(int64_t c, int64_t j) { return (c / 4 * PANEL + j) * 4 + c % 4; }

/* Q6_K's 6-bit value of column c of block b of a panel's row j (bytes: panel_bytes'). */
static int q6_at(const mcpd_matrix *w, const int64_t bytes[4], int64_t panel, int64_t b, int64_t c, int64_t j) {
    const uint8_t *values = (const uint8_t *)w->panels + panel * bytes[0] + b * Q4_HALF * PANEL;
    const uint8_t *highs = (const uint8_t *)w->highs + panel * bytes[2] + b * Q6_HIGH_BYTES * PANEL;
#if LANES == 8 && defined(__AVX2__)   /* q6_pair_avx2's arrangement: 16-bit halves of lanes */
    int64_t t = c % Q4_HALF / 4, half = j * 4 + c % 4 / 2 * 2;
    int word = values[t * PANEL * 4 + half] | values[t * PANEL * 4 + half + 1] << 8;
    int pair = highs[t / 2 * PANEL * 4 + half] | highs[t / 2 * PANEL * 4 + half + 1] << 8;
    if (c < Q4_HALF) return c % 2 ? word & 63 : (word >> 6 & 15) | (pair >> (6 + 2 * (t % 2)) & 3) << 4;
    return c % 2 ? (t % 2 ? pair >> 10 : pair & 63) : word >> 10;
#else
    uint8_t both = values[quad_byte(c % Q4_HALF, j)];
    return (c < Q4_HALF ? both & 15 : both >> 4) | (highs[quad_byte(c % 8, j)] >> (2 * (c / 8)) & 3) << 4;
#endif
}

/* Weight i of row `row` of w [n, k], as float32 (the dequantized weight of a quantized one). */
static float weight_at(int dtype, const mcpd_matrix *w, int64_t k, int64_t row, int64_t i) {
    int64_t panel = row / PANEL, j = row % PANEL, bytes[4];
    panel_bytes(dtype, w, k, bytes);
    if (w->kind >= Q4_0) {   /* [panel][i / 32] quad_byte(i % 16, j), the high nibble for i % 32 >= 16 */
        int64_t b = i / Q4_BLOCK, at = panel * PANEL * (k / Q4_BLOCK) + b * PANEL + j;
        uint8_t both = ((const uint8_t *)w->panels)[panel * bytes[0] + b * Q4_HALF * PANEL + quad_byte(i % Q4_HALF, j)];
        float q = i % Q4_BLOCK < Q4_HALF ? both & 15 : both >> 4;
        if (w->kind == Q6_K) {
            float d = (float)((const _Float16 *)w->supers)[panel * bytes[3] / 2 + i / Q4K_SUPER * PANEL + j];
            float scale = d * ((const int8_t *)w->scales)[panel * bytes[1] + i / 16 * PANEL + j];
            return ((float)q6_at(w, bytes, panel, b, i % Q4_BLOCK, j) - 32.0f) * scale;
        }
        if (w->kind == Q4_K) {
            const _Float16 *super = (const _Float16 *)w->supers + panel * bytes[3] / 2 + i / Q4K_SUPER * 2 * PANEL + j;
            return q * ((float)super[0] * ((const uint8_t *)w->scales)[at])
                   - (float)super[PANEL] * ((const uint8_t *)w->mins)[at];
        }
        float d = (float)((const _Float16 *)w->scales)[at];
        return q * d + (w->kind == Q4_1 ? (float)((const _Float16 *)w->mins)[at] : d * -8.0f);
    }
    if (w->kind == INT8)
        return ((const int8_t *)w->panels)[((panel * k / 2 + i / 2) * PANEL + j) * 2 + i % 2]   /* [panel][i / 2][j][i % 2] */
               * ((const float *)w->scales)[panel * bytes[1] / 4 + i / w->group * PANEL + j];
    if (dtype == F32) return ((const float *)w->panels)[(panel * k + i) * PANEL + j];
    return bf16_to_f32(((const bf16 *)w->panels)[((panel * k / 2 + i / 2) * PANEL + j) * 2 + i % 2]);   /* [panel][i / 2][j][i % 2] */
}

/* out[t] = row ids[t] of the packed [n, k] matrix w (a tied embedding and LM head, or a quantized
   embedding), in dtype. */
void mcpd_embedding(int dtype, const mcpd_matrix *w, int64_t k, const int64_t *ids, int64_t t, void *out) {
    for (int64_t r = 0; r < t; r++)
        for (int64_t i = 0; i < k; i++) {
            float v = weight_at(dtype, w, k, ids[r], i);
            if (dtype == F32) ((float *)out)[r * k + i] = v;
            else ((bf16 *)out)[r * k + i] = f32_to_bf16(v);
        }
}

/* out[t] = row ids[t] of a plain [n, row_bytes] table (an embedding not tied to the LM head); -1,
   copying nothing, when an id is not a row. F.embedding's result, without its dispatch: cold
   Python after the weights' stream, in every decode step. */
int mcpd_rows(const void *table, int64_t row_bytes, int64_t n, const int64_t *ids, int64_t t, void *out) {
    for (int64_t r = 0; r < t; r++)
        if (ids[r] < 0 || ids[r] >= n) return -1;
    for (int64_t r = 0; r < t; r++)
        memcpy((char *)out + r * row_bytes, (const char *)table + ids[r] * row_bytes, row_bytes);
    return 0;
}

/* ---- residual add + RMSNorm ----------------------------------------------------------------- */

/* For each of m rows of n: residual += delta (when delta is given, rounded to dtype), then
   out = weight * dtype(residual * rsqrt(mean(residual^2) + eps)), as LlamaRMSNorm computes it. */
/* Row `row` (its first element's index) of add_rms_norm_body. */
INLINE void add_rms_norm_row(int dtype, void *residual, const void *delta, const void *weight, float eps,
                             int64_t n, int64_t row, void *out) {
    f32v squares = splat(0);
    for (int64_t i = 0; i < n; i += LANES) {
        f32v v = load_any(dtype, residual, row + i);
        if (delta) {
            v = in_dtype(dtype, v + load_any(dtype, delta, row + i));
            store_any(dtype, residual, row + i, v);
        }
        squares += v * v;
    }
    float scale = 1.0f / sqrtf(hsum(squares) / (float)n + eps);
    for (int64_t i = 0; i < n; i += LANES) {
        f32v v = in_dtype(dtype, load_any(dtype, residual, row + i) * scale);
        store_any(dtype, out, row + i, load_any(dtype, weight, i) * v);
    }
}

INLINE void add_rms_norm_body(int dtype, void *residual, const void *delta, const void *weight, float eps,
                              int64_t m, int64_t n, void *out) {
    #pragma omp parallel for schedule(static) if (m * n >= 65536)
    for (int64_t r = 0; r < m; r++) add_rms_norm_row(dtype, residual, delta, weight, eps, n, r * n, out);
}

void mcpd_add_rms_norm(int dtype, void *residual, const void *delta, const void *weight, float eps, int64_t m,
                       int64_t n, void *out) {
    BY_DTYPE(add_rms_norm_body, residual, delta, weight, eps, m, n, out);
}

/* ---- rotary embedding + KV cache write ------------------------------------------------------ */

static inline float load1(int dtype, const void *p, int64_t i) {
    return dtype == F32 ? ((const float *)p)[i] : bf16_to_f32(((const bf16 *)p)[i]);
}
static inline float in_dtype1(int dtype, float v) { return dtype == F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

/* One head's d values x rotated in place by cos and sin (cos + d) of its position. */
INLINE void rotate_head(int dtype, char *x, int64_t d, const float *cos) {
    const float *sin = cos + d;
    int64_t half = d / 2;
    float rotated[MAX_HEAD_DIM];
    for (int64_t j = 0; j < half; j++) {
        float x1 = load1(dtype, x, j), x2 = load1(dtype, x, j + half);
        rotated[j] = in_dtype1(dtype, in_dtype1(dtype, x1 * cos[j]) + in_dtype1(dtype, -x2 * sin[j]));
        rotated[j + half] = in_dtype1(dtype, in_dtype1(dtype, x2 * cos[j + half])
                                             + in_dtype1(dtype, x1 * sin[j + half]));
    }
    if (dtype == F32) memcpy(x, rotated, d * 4);
    else for (int64_t j = 0; j < d; j++) ((bf16 *)x)[j] = f32_to_bf16(rotated[j]);
}

/* qkv: [t, (heads + 2 kv_heads) * d] rows (q, k, v side by side). Rotates q and k in place
   ("rotate half": x * cos + cat(-x2, x1) * sin, each product and the sum in dtype) with cos and
   sin of each token's position from table [positions, 2, d] (float32 holding dtype values), and
   copies each token's k and v into the cache: its layer view has blocks of block_stride
   elements, v at v_offset after k, a slot of kv_heads * d elements per token. Scalar loops:
   -O3 vectorizes them, and any even head size works. */
INLINE void rope_store_body(int dtype, void *qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d,
                            const int64_t *positions, const float *table, void *kv, int64_t block_stride,
                            int64_t v_offset, const int64_t *slot_blocks, const int64_t *slot_offsets) {
    int64_t width = (heads + 2 * kv_heads) * d, slot = kv_heads * d;
    size_t size = dtype == F32 ? 4 : 2;
    #pragma omp parallel for schedule(static) if (t >= 16)
    for (int64_t i = 0; i < t; i++) {
        const float *cos = table + positions[i] * 2 * d;
        char *row = (char *)qkv + i * width * size;
        for (int64_t h = 0; h < heads + kv_heads; h++) rotate_head(dtype, row + h * d * size, d, cos);
        char *dst = (char *)kv + (slot_blocks[i] * block_stride + slot_offsets[i] * slot) * size;
        memcpy(dst, row + heads * d * size, slot * size);
        memcpy(dst + v_offset * size, row + (heads + kv_heads) * d * size, slot * size);
    }
}

void mcpd_rope_store(int dtype, void *qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d,
                     const int64_t *positions, const float *table, void *kv, int64_t block_stride,
                     int64_t v_offset, const int64_t *slot_blocks, const int64_t *slot_offsets) {
    BY_DTYPE(rope_store_body, qkv, t, heads, kv_heads, d, positions, table, kv, block_stride, v_offset,
             slot_blocks, slot_offsets);
}

/* ---- SiLU(gate) * up ------------------------------------------------------------------------ */

/* One row of silu_mul_body: gate_up [2 * inter], out [inter]. */
INLINE void silu_mul_row(int dtype, const void *gate_up, int64_t inter, void *out) {
    for (int64_t i = 0; i < inter; i += LANES) {
        f32v g = load_any(dtype, gate_up, i), u = load_any(dtype, gate_up, inter + i);
        f32v silu = in_dtype(dtype, g / (1.0f + vexp(-g)));
        store_any(dtype, out, i, silu * u);
    }
}

/* gate_up: [m, 2 * inter] (gate then up); out: [m, inter] = dtype(dtype(silu(gate)) * up). */
INLINE void silu_mul_body(int dtype, const void *gate_up, int64_t m, int64_t inter, void *out) {
    #pragma omp parallel for schedule(static) if (m * inter >= 65536)
    for (int64_t r = 0; r < m; r++) silu_mul_row(dtype, (const char *)gate_up + r * 2 * inter * (dtype == F32 ? 4 : 2),
                                                 inter, (char *)out + r * inter * (dtype == F32 ? 4 : 2));
}

void mcpd_silu_mul(int dtype, const void *gate_up, int64_t m, int64_t inter, void *out) {
    BY_DTYPE(silu_mul_body, gate_up, m, inter, out);
}

/* ---- attention of one query per sequence over its paged KV ---------------------------------- */

/* LANES vectors' horizontal sums as one vector: out[c] = the sum of v[c]'s lanes. Each level of
   two-vector shuffles halves the partial sums a key keeps and doubles the keys a vector holds,
   keys staying in order: 15 shuffle pairs for 16 keys, where 16 horizontal sums take about four
   times the instructions (and score one key at a time). */
#define SUM_LEVEL(n, lo, hi) \
    for (int i = 0; i < (n) / 2; i++) \
        v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], (i32v)lo) + \
               __builtin_shuffle(v[2 * i], v[2 * i + 1], (i32v)hi)
static inline f32v sum_lanes(f32v v[LANES]) {
#if LANES == 16
    SUM_LEVEL(16, ((i32v){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                  ((i32v){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}));
    SUM_LEVEL(8, ((i32v){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}),
                 ((i32v){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}));
    SUM_LEVEL(4, ((i32v){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}),
                 ((i32v){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}));
    SUM_LEVEL(2, ((i32v){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}),
                 ((i32v){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}));
#else
    SUM_LEVEL(8, ((i32v){0, 1, 2, 3, 8, 9, 10, 11}), ((i32v){4, 5, 6, 7, 12, 13, 14, 15}));
    SUM_LEVEL(4, ((i32v){0, 1, 4, 5, 8, 9, 12, 13}), ((i32v){2, 3, 6, 7, 10, 11, 14, 15}));
    SUM_LEVEL(2, ((i32v){0, 2, 4, 6, 8, 10, 12, 14}), ((i32v){1, 3, 5, 7, 9, 11, 13, 15}));
#endif
    return v[0];
}
#undef SUM_LEVEL

/* acc[h][j] += the chunk's probabilities of head h times its values' vector j, for heads_part heads
   from h0 and `part` vectors from j0: at most ACC_VECTORS sums, in a fixed array the compiler keeps
   in registers (a variable-length one it keeps in memory, a store a sum a key). */
INLINE void add_values(int dtype, int64_t group, int64_t vecs, int64_t heads_part, int64_t part, int64_t h0,
                       int64_t j0, int64_t count, const char **key, int64_t v_bytes,
                       float scores[group][ATTN_CHUNK], f32v acc[group][vecs]) {
    f32v sums[ACC_VECTORS];
    int64_t heads = h0 + heads_part < group ? heads_part : group - h0, width = j0 + part < vecs ? part : vecs - j0;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < width; j++) sums[h * part + j] = acc[h0 + h][j0 + j];
    for (int64_t c = 0; c < count; c++)
        for (int64_t j = 0; j < width; j++) {
            f32v v = load_any(dtype, key[c] + v_bytes, (j0 + j) * LANES);
            for (int64_t h = 0; h < heads; h++) sums[h * part + j] += scores[h0 + h][c] * v;
        }
    for (int64_t h = 0; h < heads; h++)
        for (int64_t j = 0; j < width; j++) acc[h0 + h][j0 + j] = sums[h * part + j];
}

/* The key pointers of a chunk of up to ATTN_CHUNK of `left` keys, from table[*block] at *offset on
   (both advanced past it), padded with its first for a tail's LANES; how many keys it has. Its
   keys' and values' lines (`bytes` each, the values v_bytes on) are fetched into L2 now, a chunk
   ahead of their use: a key is a few of the lines of its token's slot, in blocks scattered over
   the pool, a pattern the hardware prefetcher does not follow. */
static inline int64_t chunk_keys(const char *kv, const int64_t *table, int64_t block_stride, int64_t block_size,
                                 int64_t slot, size_t size, int64_t bytes, int64_t v_bytes, int64_t left,
                                 int64_t *block, int64_t *offset, const char **keys) {
    int64_t count = left < ATTN_CHUNK ? left : ATTN_CHUNK;
    for (int64_t c = 0; c < count; c++) {
        keys[c] = kv + (table[*block] * block_stride + *offset * slot) * size;
        if (++*offset == block_size) *offset = 0, ++*block;
        for (int64_t line = 0; line < bytes; line += 64) {
            __builtin_prefetch(keys[c] + line, 0, 2);
            __builtin_prefetch(keys[c] + v_bytes + line, 0, 2);
        }
    }
    for (int64_t c = count; c < count + LANES; c++) keys[c] = keys[0];   /* a tail's padding: scores dropped */
    return count;
}

/* One KV head of one sequence: its `group` query heads (q: group * d values) over the first
   len tokens of the paged cache (kv points at this KV head's slot in block 0; tables as below).
   Online softmax over chunks of keys (flash-decoding), float32 throughout; in bfloat16 the
   probabilities are rounded before they weight the values, as torch's CPU flash attention
   does. Scores come LANES keys at a time (sum_lanes), and the value sums stay in registers
   (add_values) when group and d are constants, as decode_kv_head makes them for the usual
   shapes. A chunk's loads of keys and values are fetched ahead: from memory, a decode step's
   cache is cold (the weights streamed through since the last layer read it). */
INLINE void decode_one(int dtype, int64_t group, int64_t d, const void *q, const char *kv, int64_t block_stride,
                       int64_t v_offset, int64_t block_size, int64_t slot, const int64_t *table, int64_t len,
                       float scale, void *out) {
    size_t size = dtype == F32 ? 4 : 2;
    int64_t vecs = d / LANES, heads_part = group < ACC_VECTORS ? group : ACC_VECTORS;
    int64_t part = ACC_VECTORS / heads_part < vecs ? ACC_VECTORS / heads_part : vecs;
    f32v acc[group][vecs];
    float scores[group][ATTN_CHUNK] __attribute__((aligned(64))), best[group], total[group];
    for (int64_t h = 0; h < group; h++) {
        for (int64_t j = 0; j < vecs; j++) acc[h][j] = splat(0);
        best[h] = -INFINITY;
        total[h] = 0;
    }
    const char *keys[2][ATTN_CHUNK + LANES];
    int64_t block = 0, offset = 0;   /* where the next chunk's first key lives: table[block], slot offset */
    int64_t count = chunk_keys(kv, table, block_stride, block_size, slot, size, d * size, v_offset * size, len, &block,
                               &offset, keys[0]);
    for (int64_t c0 = 0, at = 0; c0 < len; c0 += ATTN_CHUNK, at ^= 1) {
        const char **key = keys[at];
        for (int64_t c = 0; c < count; c++)   /* its values come in while its keys are scored */
            for (int64_t line = 0; line < d * (int64_t)size; line += 64)
                __builtin_prefetch(key[c] + v_offset * size + line, 0, 3);
        int64_t next = c0 + count < len ? chunk_keys(kv, table, block_stride, block_size, slot, size, d * size,
                                                     v_offset * size, len - c0 - count, &block, &offset, keys[at ^ 1]) : 0;
        for (int64_t h = 0; h < group; h++) {
            f32v query[vecs];
            for (int64_t j = 0; j < vecs; j++) query[j] = load_any(dtype, q, h * d + j * LANES);
            for (int64_t c16 = 0; c16 < count; c16 += LANES) {
                f32v dots[LANES];
                for (int c = 0; c < LANES; c++) {
                    f32v dot = splat(0);
                    for (int64_t j = 0; j < vecs; j++) dot += query[j] * load_any(dtype, key[c16 + c], j * LANES);
                    dots[c] = dot;
                }
                store_f32(scores[h] + c16, sum_lanes(dots) * scale);
            }
        }
        for (int64_t h = 0; h < group; h++) {
            float high = best[h];
            for (int64_t c = 0; c < count; c++) high = scores[h][c] > high ? scores[h][c] : high;
            float rescale = best[h] == -INFINITY ? 0.0f : vexp(splat(best[h] - high))[0];
            best[h] = high;
            f32v sum = splat(0);
            for (int64_t c = 0; c < count; c += LANES) {
                f32v p = vexp(load_f32(scores[h] + c) - high);
                if (count - c < LANES)
                    for (int64_t z = count - c; z < LANES; z++) p[z] = 0;
                sum += p;
                store_f32(scores[h] + c, dtype == F32 ? p : round_bf16(p));
            }
            total[h] = total[h] * rescale + hsum(sum);
            for (int64_t j = 0; j < vecs; j++) acc[h][j] *= rescale;
        }
        for (int64_t h0 = 0; h0 < group; h0 += heads_part)
            for (int64_t j0 = 0; j0 < vecs; j0 += part)
                add_values(dtype, group, vecs, heads_part, part, h0, j0, count, key, v_offset * size, scores, acc);
        count = next;
    }
    for (int64_t h = 0; h < group; h++)
        for (int64_t j = 0; j < vecs; j++) store_any(dtype, out, h * d + j * LANES, acc[h][j] / total[h]);
}

/* KV head g of sequence s (table: its blocks, len: its tokens) for decode_attention_body. */
INLINE void decode_kv_head(int dtype, const void *q, int64_t q_stride, int64_t heads, int64_t kv_heads, int64_t d,
                           const void *kv, int64_t block_stride, int64_t v_offset, int64_t block_size,
                           const int64_t *table, int64_t len, float scale, void *out, int64_t s, int64_t g) {
    int64_t group = heads / kv_heads, slot = kv_heads * d;
    size_t size = dtype == F32 ? 4 : 2;
    const char *query = (const char *)q + (s * q_stride + g * group * d) * size;
    const char *cache = (const char *)kv + g * d * size;
    char *o = (char *)out + (s * heads + g * group) * d * size;
#define DECODE_ONE(G, D) decode_one(dtype, G, D, query, cache, block_stride, v_offset, block_size, slot, table, \
                                    len, scale, o)
    /* Constant shapes for the common models, so the sums stay in registers (3, 64: SmolLM2's). */
    if (group == 4 && d == 64) DECODE_ONE(4, 64);
    else if (group == 3 && d == 64) DECODE_ONE(3, 64);
    else if (group == 8 && d == 64) DECODE_ONE(8, 64);
    else if (group == 4 && d == 128) DECODE_ONE(4, 128);
    else if (group == 1 && d == 128) DECODE_ONE(1, 128);
    else DECODE_ONE(group, d);
#undef DECODE_ONE
}

/* q: [b, ...] rows of q_stride elements, heads * d queries first in each row. Sequence s attends
   to its first lens[s] tokens, held in blocks tables[s * table_stride + ...] of block_size token
   slots (cache layout as in mcpd_rope_store). out: [b, heads * d]. */
INLINE void decode_attention_body(int dtype, const void *q, int64_t q_stride, int64_t b, int64_t heads,
                                  int64_t kv_heads, int64_t d, const void *kv, int64_t block_stride,
                                  int64_t v_offset, int64_t block_size, const int64_t *tables,
                                  int64_t table_stride, const int64_t *lens, float scale, void *out) {
    int64_t keys = 0;
    for (int64_t s = 0; s < b; s++) keys += lens[s];
    /* Threads only for enough work: waking a sleeping thread costs more than a short context. */
    #pragma omp parallel for collapse(2) schedule(static) if (b * kv_heads > 1 && keys * heads * d >= (1 << 20))
    for (int64_t s = 0; s < b; s++)
        for (int64_t g = 0; g < kv_heads; g++)
            decode_kv_head(dtype, q, q_stride, heads, kv_heads, d, kv, block_stride, v_offset, block_size,
                           tables + s * table_stride, lens[s], scale, out, s, g);
}

void mcpd_decode_attention(int dtype, const void *q, int64_t q_stride, int64_t b, int64_t heads,
                           int64_t kv_heads, int64_t d, const void *kv, int64_t block_stride,
                           int64_t v_offset, int64_t block_size, const int64_t *tables, int64_t table_stride,
                           const int64_t *lens, float scale, void *out) {
    BY_DTYPE(decode_attention_body, q, q_stride, b, heads, kv_heads, d, kv, block_stride, v_offset,
             block_size, tables, table_stride, lens, scale, out);
}

/* ---- attention of prefill chunks over their paged KV ------------------------------------------ */

#define KEYS (2 * LANES)     /* keys per step: two vectors of scores per query row */
#define MAX_ROWS 64           /* query rows (queries x heads of one KV head) per work unit */
#if LANES == 16
static const f32v lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define ROW_GROUP 8           /* rows whose accumulators stay in registers together */
#define VALUE_VECS 1          /* vectors of a row's values summed at once */
#else
static const f32v lane_index = {0, 1, 2, 3, 4, 5, 6, 7};
#define ROW_GROUP 6           /* 12 accumulators and 2 keys of AVX2's 16 registers */
/* The value sums 2 vectors of a row at once (head sizes are multiples of 16): 12 accumulators,
   where 6 chains leave half of AVX2's FMA throughput waiting on its latency. */
#define VALUE_VECS 2
#endif

/* The keys and values of one KV head at positions c0 .. c0 + n - 1 as float32: keys transposed
   into kt[d][KEYS], so that a query row's scores for all of them are d broadcast multiply-adds;
   values as vt[KEYS][d]; missing keys zero. Done once per chunk for every row of the unit. */
static void load_chunk(int dtype, const char *kv, const int64_t *table, int64_t block_size, int64_t block_stride,
                       int64_t v_offset, int64_t slot, int64_t g, int64_t d, int64_t c0, int64_t n, float *kt,
                       float *vt) {
    size_t size = dtype == F32 ? 4 : 2;
    for (int64_t c = 0; c < KEYS; c++) {
        if (c >= n) {
            for (int64_t j = 0; j < d; j++) kt[j * KEYS + c] = vt[c * d + j] = 0.0f;
            continue;
        }
        int64_t pos = c0 + c;
        const char *key = kv + (table[pos / block_size] * block_stride + (pos % block_size) * slot + g * d) * size;
        for (int64_t j = 0; j < d; j += LANES) {
            f32v k = load_any(dtype, key, j);
            for (int i = 0; i < LANES; i++) kt[(j + i) * KEYS + c] = k[i];
            store_f32(vt + c * d + j, load_any(dtype, key + v_offset * size, j));
        }
    }
}

/* Sequence s computes counts[s] new tokens at positions starts[s] ..., whose queries are rows
   q_rows[s] ... of q (rows of q_stride elements, heads * d queries first); each attends to the
   keys at its own position and before (the new tokens' keys are already in the cache). Work
   units are (sequence, KV head, tile of queries): rows = the tile's queries x the query heads
   of that KV head, which share every key chunk. Online softmax as in mcpd_decode_attention.
   out: [rows of the flat batch, heads * d]. */
INLINE void prefill_attention_body(int dtype, const void *q, int64_t q_stride, int64_t b,
                                   const int64_t *q_rows, const int64_t *starts, const int64_t *counts,
                                   int64_t heads, int64_t kv_heads, int64_t d, const void *kv,
                                   int64_t block_stride, int64_t v_offset, int64_t block_size,
                                   const int64_t *tables, int64_t table_stride, float scale, void *out) {
    int64_t group = heads / kv_heads, slot = kv_heads * d, tile = MAX_ROWS / group;
    size_t size = dtype == F32 ? 4 : 2;
    int64_t units = 0, first_unit[b + 1];
    for (int64_t s = 0; s < b; s++) {
        first_unit[s] = units;
        units += kv_heads * ((counts[s] + tile - 1) / tile);
    }
    first_unit[b] = units;
    #pragma omp parallel for schedule(dynamic, 1) if (units > 1)
    for (int64_t unit = 0; unit < units; unit++) {
        int64_t s = 0;
        while (first_unit[s + 1] <= unit) s++;
        int64_t tiles = (counts[s] + tile - 1) / tile, g = (unit - first_unit[s]) / tiles;
        int64_t q0 = (unit - first_unit[s]) % tiles * tile;          /* first query of the tile */
        int64_t queries = counts[s] - q0 < tile ? counts[s] - q0 : tile, rows = queries * group;
        int64_t padded = (rows + ROW_GROUP - 1) / ROW_GROUP * ROW_GROUP;   /* extra rows: zeros, unused */
        /* heap, not stack: up to ~170 KB, more than a thread's stack may hold */
        float *query = calloc(padded * d * 2 + d * KEYS * 2 + padded * KEYS, sizeof(float));
        float *acc = query + padded * d, *kt = acc + padded * d, *vt = kt + d * KEYS, *scores = vt + d * KEYS;
        float best[MAX_ROWS], total[MAX_ROWS], rescales[MAX_ROWS + ROW_GROUP];
        for (int64_t r = 0; r < padded; r++) rescales[r] = 1.0f;   /* padding rows: never rescaled */
        for (int64_t r = 0; r < rows; r++) {   /* row r: query q0 + r / group, head g * group + r % group */
            int64_t row = q_rows[s] + q0 + r / group, head = g * group + r % group;
            const char *src = (const char *)q + (row * q_stride + head * d) * size;
            for (int64_t j = 0; j < d; j++) query[r * d + j] = load1(dtype, src, j);
            best[r] = -INFINITY;
            total[r] = 0;
        }
        const int64_t *table = tables + s * table_stride;
        int64_t first_pos = starts[s] + q0, keys = first_pos + queries;
        for (int64_t c0 = 0; c0 < keys; c0 += KEYS) {
            int64_t n = keys - c0 < KEYS ? keys - c0 : KEYS;
            load_chunk(dtype, (const char *)kv, table, block_size, block_stride, v_offset, slot, g, d, c0, n,
                       kt, vt);
            for (int64_t r0 = 0; r0 < padded; r0 += ROW_GROUP) {
                f32v lo[ROW_GROUP] = {{0}}, hi[ROW_GROUP] = {{0}};
                for (int64_t j = 0; j < d; j++) {
                    f32v k0 = load_f32(kt + j * KEYS), k1 = load_f32(kt + j * KEYS + LANES);
                    for (int r = 0; r < ROW_GROUP; r++) {
                        float x = query[(r0 + r) * d + j];
                        lo[r] += x * k0;
                        hi[r] += x * k1;
                    }
                }
                for (int r = 0; r < ROW_GROUP; r++) {
                    store_f32(scores + (r0 + r) * KEYS, lo[r] * scale);
                    store_f32(scores + (r0 + r) * KEYS + LANES, hi[r] * scale);
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                f32v s0 = load_f32(scores + r * KEYS), s1 = load_f32(scores + r * KEYS + LANES);
                float visible = first_pos + r / group - c0 + 1;   /* causal: keys up to the query's position */
                if (visible < KEYS) {
                    s0 = where(lane_index < visible, s0, splat(-INFINITY));
                    s1 = where(lane_index + LANES < visible, s1, splat(-INFINITY));
                }
                float high = hmax(vmax(s0, s1));
                high = high > best[r] ? high : best[r];
                float rescale = best[r] == -INFINITY ? 0.0f : expf(best[r] - high);
                f32v p0 = vexp(s0 - high), p1 = vexp(s1 - high);
                total[r] = total[r] * rescale + hsum(p0 + p1);
                best[r] = high;
                store_f32(scores + r * KEYS, dtype == F32 ? p0 : round_bf16(p0));
                store_f32(scores + r * KEYS + LANES, dtype == F32 ? p1 : round_bf16(p1));
                rescales[r] = rescale;
            }
            for (int64_t j = 0; j < d; j += VALUE_VECS * LANES)
                for (int64_t r0 = 0; r0 < padded; r0 += ROW_GROUP) {
                    f32v a[ROW_GROUP][VALUE_VECS];
                    for (int r = 0; r < ROW_GROUP; r++)   /* rescaled as loaded: one pass over acc a chunk */
                        for (int h = 0; h < VALUE_VECS; h++)
                            a[r][h] = load_f32(acc + (r0 + r) * d + j + h * LANES) * rescales[r0 + r];
                    for (int64_t c = 0; c < n; c++) {
                        f32v v[VALUE_VECS];
                        for (int h = 0; h < VALUE_VECS; h++) v[h] = load_f32(vt + c * d + j + h * LANES);
                        for (int r = 0; r < ROW_GROUP; r++) {
                            float p = scores[(r0 + r) * KEYS + c];
                            for (int h = 0; h < VALUE_VECS; h++) a[r][h] += p * v[h];
                        }
                    }
                    for (int r = 0; r < ROW_GROUP; r++)
                        for (int h = 0; h < VALUE_VECS; h++) store_f32(acc + (r0 + r) * d + j + h * LANES, a[r][h]);
                }
        }
        for (int64_t r = 0; r < rows; r++) {
            int64_t row = q_rows[s] + q0 + r / group, head = g * group + r % group;
            for (int64_t j = 0; j < d; j += LANES)
                store_any(dtype, out, (row * heads + head) * d + j, load_f32(acc + r * d + j) / total[r]);
        }
        free(query);
    }
}

void mcpd_prefill_attention(int dtype, const void *q, int64_t q_stride, int64_t b, const int64_t *q_rows,
                            const int64_t *starts, const int64_t *counts, int64_t heads, int64_t kv_heads,
                            int64_t d, const void *kv, int64_t block_stride, int64_t v_offset,
                            int64_t block_size, const int64_t *tables, int64_t table_stride, float scale,
                            void *out) {
    BY_DTYPE(prefill_attention_body, q, q_stride, b, q_rows, starts, counts, heads, kv_heads, d, kv,
             block_stride, v_offset, block_size, tables, table_stride, scale, out);
}

/* ---- the decoder stack in one call ------------------------------------------------------ */

/* Why one call: at batch 1 a layer's nine kernels take tens of microseconds each, and calling
   them one by one from Python (ctypes, a fresh torch tensor per result) costs about as much
   again. The loop below runs the same kernels in the same order as LlamaForCausalLM.forward
   does with the torch kernels, on scratch rows reused by every layer. */

typedef struct {          /* one decoder layer: packed weight matrices, biases or NULL, norms, KV */
    mcpd_matrix qkv, o, gate_up, down;
    const void *input_norm, *qkv_bias, *o_bias, *post_norm, *gate_up_bias, *down_bias;
    void *kv;             /* the layer's paged cache (layout as in mcpd_rope_store) */
} mcpd_layer;

typedef struct {          /* the model's sizes and the cache's layout, the same for every layer */
    int64_t hidden, inter, heads, kv_heads, head_dim, block_stride, v_offset, block_size;
    float eps, scale;
} mcpd_shape;

typedef struct {          /* one attention group of the step (layers.AttentionGroup) */
    int64_t decoding, start, b, table_stride;
    const int64_t *table, *lens, *first_rows, *starts, *counts;
} mcpd_group;

/* Bytes of scratch mcpd_decoder_stack needs for t rows. */
int64_t mcpd_stack_scratch_bytes(int dtype, const mcpd_shape *s, int64_t t) {
    int64_t q_size = s->heads * s->head_dim, qkv_n = q_size + 2 * s->kv_heads * s->head_dim;
    return t * (2 * s->hidden + qkv_n + q_size + 3 * s->inter) * (dtype == F32 ? 4 : 2);
}

/* Rows at[0 .. n - 1] of rows of `width` bytes moved to rows 0 .. n - 1, in place (at ascending). */
static void keep_rows(char *rows, int64_t width, const int64_t *at, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (at[i] != i) memcpy(rows + i * width, rows + at[i] * width, width);
}

/* The attention groups of the kept rows at[0 .. n - 1] (ascending, each the last row of its
   sequence in the step): of each group, the sequences whose last row is kept, one query each,
   their rows renumbered 0 .. n - 1. Their tables and lengths are copied into `arrays`, at least
   n * (the widest table + 4) elements. Returns how many groups went to out (at most num_groups). */
static int64_t kept_groups(const mcpd_group *groups, int64_t num_groups, const int64_t *at, int64_t n,
                           int64_t *arrays, mcpd_group *out) {
    int64_t made = 0, next = 0;   /* next: the first kept row not yet placed */
    for (const mcpd_group *g = groups; g < groups + num_groups; g++) {
        int64_t kept[n], b = 0;   /* the group's sequences kept */
        for (int64_t seq = 0; seq < g->b && next < n; seq++)
            if (at[next] == g->start + (g->decoding ? seq : g->first_rows[seq] + g->counts[seq] - 1))
                kept[b++] = seq, next++;
        if (!b) continue;
        int64_t *table = arrays, *lens = table + b * g->table_stride, *firsts = lens + b, *starts = firsts + b;
        int64_t *counts = starts + b;
        for (int64_t i = 0; i < b; i++) {
            int64_t seq = kept[i], last = g->lens[seq] - 1;   /* the position of its last row */
            memcpy(table + i * g->table_stride, g->table + seq * g->table_stride, g->table_stride * sizeof *table);
            lens[i] = last + 1, firsts[i] = i, starts[i] = last, counts[i] = 1;
        }
        out[made++] = (mcpd_group){g->decoding, next - b, b, g->table_stride, table, lens, firsts, starts, counts};
        arrays = counts + b;
    }
    return made;
}

/* This thread's contiguous share of the runs (row_runs) or strips of each part of w (as linear: its
   columns of y [1, n] and of the bias) times x's one row, x prepared by this thread. */
static void row_share(int dtype, const void *x, int64_t k, const mcpd_matrix *w, const void *bias, int64_t n, void *y,
                      int thread, int threads) {
    size_t size = dtype == F32 ? 4 : 2;
    for (int64_t at = 0; w; w = w->next) {
        int64_t rows = w->next ? w->rows : n - at, first, end, bytes[4];
        const void *part_bias = bias ? (const char *)bias + at * size : NULL;
        char *part_y = (char *)y + at * size;
        if (takes_row_runs(dtype, w, k)) {
            contiguous_share((rows + PANEL * ROW_PANELS - 1) / (PANEL * ROW_PANELS), thread, threads, &first, &end);
            row_runs(dtype, x, k, w->panels, part_bias, rows, part_y, n, 0, first, end);
        } else {
            contiguous_share((rows + PANEL * TILE_PANELS - 1) / (PANEL * TILE_PANELS), thread, threads, &first, &end);
            if (first < end) {
                panel_bytes(dtype, w, k, bytes);
                product_x px = product_x_of(dtype, x, 1, k, w->kind);
                for (int64_t strip = first; strip < end; strip++)
                    strip_product(dtype, px, 1, k, w, bytes, strip, part_bias, rows, part_y, n, 0);
                product_x_free(px);
            }
        }
        at += rows;
    }
}

/* Whether the stack's step is one decoding row (one_row_stack's case). */
static int one_decoding_row(int64_t t, const mcpd_group *groups, int64_t num_groups, int64_t kept,
                            const int64_t *kept_rows) {
    return t == 1 && num_groups == 1 && groups[0].decoding && groups[0].b == 1
           && (kept < 0 || (kept == 1 && !kept_rows[0]));
}

/* mcpd_decoder_stack for one_decoding_row: one parallel region for the whole stack, not one for
   each of a layer's four products (a fork and a join each). Each thread keeps its own copy of the
   row's residual and does the row's norms and SiLU itself (microseconds, the same values), so the
   only waits are the five for what every thread needs whole: q/k/v, the attention, o, gate/up and
   down. A thread rotates, stores and attends its own KV heads with no wait between, rather than
   one thread attending every head while the others wait. Per value, the kernels, inputs and order of
   the general path: the same bits. Scratch: delta, qkv, attended, gate_up of the one row. */
INLINE void one_row_stack_body(int dtype, const mcpd_shape *s, const mcpd_layer *layers, int64_t num_layers,
                               void *residual, const float *rope, int64_t position, int64_t slot_block,
                               int64_t slot_offset, const mcpd_group *g, void *scratch, const void *final_norm,
                               void *out) {
    size_t size = dtype == F32 ? 4 : 2;
    int64_t d = s->head_dim, group = s->heads / s->kv_heads, q_size = s->heads * d, slot = s->kv_heads * d;
    int64_t qkv_n = q_size + 2 * slot, hidden = s->hidden * size;
    char *delta = scratch, *qkv = delta + hidden, *attended = qkv + qkv_n * size, *gate_up = attended + q_size * size;
    const float *cos = rope + position * 2 * d;
    #pragma omp parallel
    {
        int thread, threads;
        team_place(&thread, &threads);
        char *mine = malloc(2 * hidden + s->inter * size), *x = mine + hidden, *act = x + hidden;
        const void *pending = NULL;
        memcpy(mine, residual, hidden);
        for (const mcpd_layer *w = layers; w < layers + num_layers; w++) {
            add_rms_norm_row(dtype, mine, pending, w->input_norm, s->eps, s->hidden, 0, x);
            row_share(dtype, x, s->hidden, &w->qkv, w->qkv_bias, qkv_n, qkv, thread, threads);
            #pragma omp barrier
            for (int64_t h = thread; h < s->kv_heads; h += threads) {
                char *key = qkv + (q_size + h * d) * size;
                char *cached = (char *)w->kv + (slot_block * s->block_stride + slot_offset * slot + h * d) * size;
                for (int64_t j = 0; j < group; j++) rotate_head(dtype, qkv + (h * group + j) * d * size, d, cos);
                rotate_head(dtype, key, d, cos);
                memcpy(cached, key, d * size);
                memcpy(cached + s->v_offset * size, key + slot * size, d * size);
                decode_kv_head(dtype, qkv, qkv_n, s->heads, s->kv_heads, d, w->kv, s->block_stride, s->v_offset,
                               s->block_size, g->table, g->lens[0], s->scale, attended, 0, h);
            }
            #pragma omp barrier
            row_share(dtype, attended, q_size, &w->o, w->o_bias, s->hidden, delta, thread, threads);
            #pragma omp barrier
            add_rms_norm_row(dtype, mine, delta, w->post_norm, s->eps, s->hidden, 0, x);
            row_share(dtype, x, s->hidden, &w->gate_up, w->gate_up_bias, 2 * s->inter, gate_up, thread, threads);
            #pragma omp barrier
            silu_mul_row(dtype, gate_up, s->inter, act);
            row_share(dtype, act, s->inter, &w->down, w->down_bias, s->hidden, delta, thread, threads);
            #pragma omp barrier
            pending = delta;
        }
        if (thread == 0) {
            memcpy(residual, mine, hidden);
            add_rms_norm_row(dtype, residual, pending, final_norm, s->eps, s->hidden, 0, out);
        }
        free(mine);
    }
}

/* residual: [t, hidden], the embeddings, updated in place; out: [t, hidden], the final norm of
   the last residual. rope, positions and slots as mcpd_rope_store takes them. kept: -1 for every
   row, else how many rows out gets: kept_rows, ascending, each the last of its sequence in the
   step (rows that sample; none in a prompt's middle chunk). No other row's attention, MLP or
   final norm feeds anything, so the last layer carries only those on past storing every row's
   keys and values; residual's first rows are then theirs. */
void mcpd_decoder_stack(int dtype, const mcpd_shape *s, const mcpd_layer *layers, int64_t num_layers, int64_t t,
                        void *residual, const float *rope, const int64_t *positions, const int64_t *slot_blocks,
                        const int64_t *slot_offsets, const mcpd_group *groups, int64_t num_groups, int64_t kept,
                        const int64_t *kept_rows, void *scratch, const void *final_norm, void *out) {
    amx_new_call();
    if (one_decoding_row(t, groups, num_groups, kept, kept_rows)) {
        BY_DTYPE(one_row_stack_body, s, layers, num_layers, residual, rope, positions[0], slot_blocks[0],
                 slot_offsets[0], groups, scratch, final_norm, out);
        return;
    }
    size_t size = dtype == F32 ? 4 : 2;
    int64_t d = s->head_dim, q_size = s->heads * d, qkv_n = q_size + 2 * s->kv_heads * d;
    char *x = scratch, *delta = x + t * s->hidden * size, *qkv = delta + t * s->hidden * size;
    char *attended = qkv + t * qkv_n * size, *gate_up = attended + t * q_size * size;
    char *act = gate_up + t * 2 * s->inter * size;
    const void *pending = NULL;   /* the delta the next norm adds to the residual first */
    int64_t widest = 0;
    for (int64_t i = 0; kept > 0 && i < num_groups; i++)
        widest = groups[i].table_stride > widest ? groups[i].table_stride : widest;
    mcpd_group kept_records[num_groups];
    int64_t *kept_arrays = kept > 0 ? malloc(kept * (widest + 4) * sizeof *kept_arrays) : NULL;
    for (int64_t l = 0; l < num_layers; l++) {
        const mcpd_layer *w = layers + l;
        mcpd_add_rms_norm(dtype, residual, pending, w->input_norm, s->eps, t, s->hidden, x);
        linear(dtype, x, t, s->hidden, &w->qkv, w->qkv_bias, qkv_n, qkv, 0);
        mcpd_rope_store(dtype, qkv, t, s->heads, s->kv_heads, d, positions, rope, w->kv, s->block_stride,
                        s->v_offset, slot_blocks, slot_offsets);
        if (kept >= 0 && l == num_layers - 1) {   /* every row's keys and values are stored: on with the kept */
            t = kept;
            if (!t) break;
            keep_rows(residual, s->hidden * size, kept_rows, kept);
            keep_rows(qkv, qkv_n * size, kept_rows, kept);
            num_groups = kept_groups(groups, num_groups, kept_rows, kept, kept_arrays, kept_records);
            groups = kept_records;
        }
        for (int64_t i = 0; i < num_groups; i++) {
            const mcpd_group *g = groups + i;
            const char *q = qkv + g->start * qkv_n * size;
            char *o = attended + g->start * q_size * size;
            if (g->decoding)
                mcpd_decode_attention(dtype, q, qkv_n, g->b, s->heads, s->kv_heads, d, w->kv, s->block_stride,
                                      s->v_offset, s->block_size, g->table, g->table_stride, g->lens, s->scale, o);
            else
                mcpd_prefill_attention(dtype, q, qkv_n, g->b, g->first_rows, g->starts, g->counts, s->heads,
                                       s->kv_heads, d, w->kv, s->block_stride, s->v_offset, s->block_size,
                                       g->table, g->table_stride, s->scale, o);
        }
        linear(dtype, attended, t, q_size, &w->o, w->o_bias, s->hidden, delta, 0);
        mcpd_add_rms_norm(dtype, residual, delta, w->post_norm, s->eps, t, s->hidden, x);
        linear(dtype, x, t, s->hidden, &w->gate_up, w->gate_up_bias, 2 * s->inter, gate_up, 0);
        mcpd_silu_mul(dtype, gate_up, t, s->inter, act);
        linear(dtype, act, t, s->inter, &w->down, w->down_bias, s->hidden, delta, 0);
        pending = delta;
    }
    mcpd_add_rms_norm(dtype, residual, pending, final_norm, s->eps, t, s->hidden, out);
    free(kept_arrays);
}

/* ---- greedy choice -------------------------------------------------------------------------- */

/* out[r] = the index of row r's largest of n float32 logits: the first of equal maxima, and the
   first NaN where a row has one (numpy's argmax, as TorchKernels.argmax takes it). One native
   call: converting a step's fresh logits to numpy and back is cold Python after the weights'
   stream, several times the argmax itself. */
void mcpd_argmax(const float *y, int64_t m, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < m; r++, y += n) {
        f32v best = splat(-INFINITY);
        i32v nan = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            f32v v = load_f32(y + i);
            nan |= v != v;
            best = vmax(v, best);   /* a NaN compares false: kept out of the maximum */
        }
        float top = hmax(best);
        int any_nan = 0;
        for (int j = 0; j < LANES; j++) any_nan |= nan[j];
        for (int64_t j = i; j < n; j++) {
            any_nan |= y[j] != y[j];
            if (y[j] > top) top = y[j];
        }
        int64_t at = 0;
        while (at < n && !(any_nan ? y[at] != y[at] : y[at] == top)) at++;
        out[r] = at < n ? at : 0;   /* n == 0 only */
    }
}

/* ---- greedy decode steps ----------------------------------------------------------------------- */

typedef struct {          /* what a greedy step reads besides the layers (NativeStack.greedy_steps) */
    mcpd_matrix embedding;            /* panels of a plain [rows, hidden] table (plain), else packed */
    int64_t rows, plain;
    mcpd_matrix head;                 /* packed [vocab, hidden] */
    int64_t vocab;
    const void *final_norm;
    const float *rope;
    const int64_t *table;             /* the sequence's block table: a slot for every position written */
    int64_t table_len;
} mcpd_greedy;

/* Up to `steps` greedy decode steps of one sequence, each what a Python step runs for it (the
   token's embedding, the decoder stack, the LM head's float32 logits, their argmax), the token each
   chose being the next one's input, with no Python between them. token: the last sampled token;
   position: where it goes. The loop ends early after a token of stops. out_tokens gets the tokens;
   returns how many, or -1, having run nothing, when token is not a row of the embedding or a
   position lies outside the table. scratch as mcpd_decoder_stack's for one row; residual and
   hidden [hidden] of dtype, logits [vocab] float32. */
int64_t mcpd_greedy_steps(int dtype, const mcpd_shape *s, const mcpd_layer *layers, int64_t num_layers,
                          const mcpd_greedy *g, int64_t token, int64_t position, int64_t steps,
                          const int64_t *stops, int64_t num_stops, void *scratch, void *residual, void *hidden,
                          float *logits, int64_t *out_tokens) {
    amx_new_call();
    int64_t row_bytes = s->hidden * (dtype == F32 ? 4 : 2);
    if (token < 0 || token >= g->rows || steps < 0 || position < 0
        || position > g->table_len * s->block_size - steps)   /* no overflow for any position */
        return -1;
    int64_t lens, slot_block, slot_offset;
    mcpd_group one = {1, 0, 1, g->table_len, g->table, &lens, NULL, NULL, NULL};
    for (int64_t n = 0; n < steps; n++) {
        int64_t at = position + n;
        if (g->plain) mcpd_rows(g->embedding.panels, row_bytes, g->rows, &token, 1, residual);   /* in range: checked */
        else mcpd_embedding(dtype, &g->embedding, s->hidden, &token, 1, residual);
        slot_block = g->table[at / s->block_size], slot_offset = at % s->block_size, lens = at + 1;
        mcpd_decoder_stack(dtype, s, layers, num_layers, 1, residual, g->rope, &at, &slot_block, &slot_offset, &one,
                           1, -1, NULL, scratch, g->final_norm, hidden);
        linear(dtype, hidden, 1, s->hidden, &g->head, NULL, g->vocab, logits, 1);
        mcpd_argmax(logits, 1, g->vocab, &token);
        out_tokens[n] = token;
        for (int64_t i = 0; i < num_stops; i++)
            if (token == stops[i]) return n + 1;
        if (token >= g->rows) return n + 1;   /* a head wider than the embedding: no next input */
    }
    return steps;
}

/* ---- runtime -------------------------------------------------------------------------------- */

int mcpd_max_threads(void) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* The kernel's thread id of each thread of an OpenMP team of `most` (tids[i] is thread i's; 0 is
   the caller's), and how many the team had. The engine watches how long they wait for a CPU
   (/proc/self/task/TID/schedstat, mcpd/cpu/run_delay.py): a neighbour on one of their cores. */
int mcpd_team_tids(int64_t *tids, int most) {
    int team = 1;
    tids[0] = syscall(SYS_gettid);
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    #pragma omp parallel num_threads(most)
    {
        tids[omp_get_thread_num()] = syscall(SYS_gettid);
        if (omp_get_thread_num() == 0)
            team = omp_get_num_threads();
    }
#endif
    return team;
}

int mcpd_has_avx512_bf16(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
