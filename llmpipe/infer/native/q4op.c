/* llmpipe.Q4Gemv: llmpipe's 4-bit matmul kernel (q4_kernel.h) as an onnxruntime custom op.
 *
 *   Q4Gemv(A float [..., K], Q uint8 [N/8, K/32, 32 * bits], D float16 [N/8, K/32, 8], M float16 [same]
 *          [, QA uint8 [R/8, KA/32, 256], DA, MA float16 [R/8, KA/32, 8]])
 *     -> Y float [..., N]          attributes K, N, bits (4 or 8; absent: 4), layout (2; absent: 1), rows_a
 *
 * The weights are in q4_kernel.h's layout 2. A node without `layout` (a graph an older llmpipe wrote, in
 * layout 1) has its constant weights rewritten into layout 2 once, when its kernel is created.
 *
 * With the optional QA, DA, MA (a LoRA adapter's A, R rows at 8 bits; llmpipe.infer.lora_rows' rows kept
 * apart): A is [..., KA] with KA = K - R, and the op computes A . [W_base; B rows] over concat(A, A . A_lora^T),
 * the adapter's product first (from the same quantised A), so the graph needs no MatMul and Concat for it.
 *
 * onnxruntime loads this library through SessionOptions.register_custom_ops_library, which calls
 * RegisterCustomOps below. Its C API headers are not in the onnxruntime wheel (and no registry this project
 * installs from serves them), so the few declarations used are written here from the documented ABI: the
 * OrtApiBase struct, the OrtCustomOp struct (fields in their documented order, `version` telling onnxruntime
 * which it may read), and the OrtApi function table, append-only since 1.0, read by slot index. The slots
 * are checked when the library registers: the slot of GetBuildInfoString must return onnxruntime's build
 * string, or registration fails with that message instead of calling a wrong function.
 *
 * The weights' matmul runs in tiles of 8 output rows split across onnxruntime's intra-op threads
 * (KernelContext_ParallelFor); the activation is quantised once per call, in a buffer of the call's own.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_kernel.h"

/* ---- the onnxruntime ABI, as documented (onnxruntime_c_api.h) ---------------------------------------- */
typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef void *OrtApiTable; /* the OrtApi struct: function pointers only, read by slot */

typedef struct OrtApiBase {
  const OrtApiTable *(*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };                     /* OrtErrorCode */
enum { T_FLOAT = 1, T_UINT8 = 2, T_FLOAT16 = 10 };                               /* ONNXTensorElementDataType */

typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *, const void *, const OrtKernelInfo *);
  const char *(*GetName)(const struct OrtCustomOp *);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *);
  int (*GetInputType)(const struct OrtCustomOp *, size_t);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *);
  int (*GetOutputType)(const struct OrtCustomOp *, size_t);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *);
  void (*KernelCompute)(void *, OrtKernelContext *);
  void (*KernelDestroy)(void *);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *, size_t);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *, size_t);
  int (*GetInputMemoryType)(const struct OrtCustomOp *, size_t);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp *);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *);
  OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *, const void *, const OrtKernelInfo *, void **);
  OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
  void *InferOutputShapeFn, *GetStartVersion, *GetEndVersion, *GetMayInplace, *ReleaseMayInplace, *GetAliasMap,
      *ReleaseAliasMap; /* read only by onnxruntime for op versions above the one declared here */
} OrtCustomOp;

#define API_VERSION 20      /* the OrtApi asked for: KernelContext_ParallelFor is in it (onnxruntime >= 1.20) */
#define OP_VERSION 16       /* OrtCustomOp fields through KernelComputeV2 */

/* OrtApi slots (0-based) */
enum {
  S_CreateStatus = 0,
  S_CreateCustomOpDomain = 26,
  S_CustomOpDomain_Add = 27,
  S_AddCustomOpDomain = 28,
  S_GetTensorMutableData = 51,
  S_GetDimensionsCount = 61,
  S_GetDimensions = 62,
  S_GetTensorShapeElementCount = 64,
  S_GetTensorTypeAndShape = 65,
  S_KernelInfoGetAttribute_int64 = 86,
  S_KernelContext_GetInputCount = 88,
  S_KernelContext_GetInput = 90,
  S_KernelContext_GetOutput = 91,
  S_ReleaseStatus = 93,
  S_ReleaseTensorTypeAndShapeInfo = 99,
  S_KernelInfo_GetInputCount = 230,
  S_HasSessionConfigEntry = 237,
  S_GetSessionConfigEntry = 238,
  S_KernelInfoGetConstantInput_tensor = 249,
  S_GetBuildInfoString = 254,
  S_KernelContext_ParallelFor = 274,
};

static const OrtApiTable *api;
#define FN(slot, type) ((type)api[slot])

static OrtStatus *status(int code, const char *msg) {
  return FN(S_CreateStatus, OrtStatus *(*)(int, const char *))(code, msg);
}

#define TRY(call)                     \
  do {                                \
    OrtStatus *st_ = (call);          \
    if (st_) return st_;              \
  } while (0)

/* ---- the op ------------------------------------------------------------------------------------------- */
typedef struct {
  int64_t K, N, bits, rows_a; /* rows_a: the adapter's rows that are not zero padding (0: all) */
  int threads; /* the session's intra-op threads, 0 when llmpipe did not say (llmpipe.infer.native.register) */
  void *own[6]; /* a layout-1 graph's Q, D, M (, QA, DA, MA) rewritten in layout 2 at creation, else NULL */
} Kernel;

/* The op as registered in one session's options: onnxruntime hands this pointer back to CreateKernelV2. */
typedef struct {
  OrtCustomOp op; /* first: the pointer onnxruntime holds is this struct's */
  int threads;
} RegisteredOp;

static const char *op_name(const OrtCustomOp *op) { (void)op; return "Q4Gemv"; }
static const char *op_ep(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int op_input_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 0 ? T_FLOAT : (i == 1 || i == 4) ? T_UINT8 : T_FLOAT16;
}
static size_t op_input_count(const OrtCustomOp *op) { (void)op; return 7; }
static int op_output_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return T_FLOAT; }
static size_t op_output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int op_required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return 0; /* INPUT_OUTPUT_REQUIRED */ }
static int op_input_kind(const OrtCustomOp *op, size_t i) { (void)op; return i < 4 ? 0 : 1; /* OPTIONAL: QA, DA, MA */ }
static int op_mem_default(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return 0; /* OrtMemTypeDefault */ }
static int op_one(const OrtCustomOp *op) { (void)op; return 1; }
static void op_destroy(void *kp) {
  Kernel *k = kp;
  if (k)
    for (int i = 0; i < 6; i++) free(k->own[i]);
  free(k);
}

static OrtStatus *data(const OrtValue *v, void **p);
static OrtStatus *count_of(const OrtValue *v, size_t *count);

/* A layout-1 node (no `layout` attribute: what llmpipe wrote before layout 2) gets its constant weights
 * rewritten in layout 2 once (q4_relayout), so a graph an older llmpipe made runs without being made again. */
static OrtStatus *relayout(Kernel *k, const OrtKernelInfo *info) {
  size_t n = 0;
  TRY(FN(S_KernelInfo_GetInputCount, OrtStatus *(*)(const OrtKernelInfo *, size_t *))(info, &n));
  for (int g = 0; g < (n >= 7 ? 2 : 1); g++) { /* the weight, then the adapter's */
    const OrtValue *v[3];
    void *p[3];
    size_t c[3];
    for (int i = 0; i < 3; i++) {
      int constant = 0;
      TRY(FN(S_KernelInfoGetConstantInput_tensor, OrtStatus *(*)(const OrtKernelInfo *, size_t, int *,
                                                                 const OrtValue **))(info, 1 + 3 * g + i, &constant, &v[i]));
      if (!constant || !v[i])
        return status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: a layout-1 node's weights must be initializers");
      TRY(data(v[i], &p[i]));
      TRY(count_of(v[i], &c[i]));
    }
    const int planes = g ? 2 : (int)k->bits / 4;
    const size_t blocks = c[0] / (128 * (size_t)planes);
    if (c[0] != blocks * 128 * planes || c[1] != blocks * 8 || c[2] != blocks * 8)
      return status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: a weight input's size does not fit K, N");
    uint8_t *q = calloc(c[0], 1);
    uint16_t *d = malloc(c[1] * 2), *m = malloc(c[2] * 2);
    k->own[3 * g] = q, k->own[3 * g + 1] = d, k->own[3 * g + 2] = m;
    if (!q || !d || !m) return status(ORT_FAIL, "llmpipe.Q4Gemv: out of memory");
    q4_relayout(p[0], p[1], p[2], q, d, m, blocks, planes);
  }
  return NULL;
}

static OrtStatus *op_create(const OrtCustomOp *op, const void *a, const OrtKernelInfo *info, void **out) {
  (void)a;
  typedef OrtStatus *(*GetInt)(const OrtKernelInfo *, const char *, int64_t *);
  Kernel *k = calloc(1, sizeof *k);
  if (!k) return status(ORT_FAIL, "llmpipe.Q4Gemv: out of memory");
  OrtStatus *st = FN(S_KernelInfoGetAttribute_int64, GetInt)(info, "K", &k->K);
  if (!st) st = FN(S_KernelInfoGetAttribute_int64, GetInt)(info, "N", &k->N);
  if (!st) {
    OrtStatus *absent = FN(S_KernelInfoGetAttribute_int64, GetInt)(info, "bits", &k->bits);
    if (absent) { /* no bits attribute: 4 */
      FN(S_ReleaseStatus, void (*)(OrtStatus *))(absent);
      k->bits = 4;
    }
  }
  if (!st) {
    OrtStatus *absent = FN(S_KernelInfoGetAttribute_int64, GetInt)(info, "rows_a", &k->rows_a);
    if (absent) { /* no rows_a attribute: every row */
      FN(S_ReleaseStatus, void (*)(OrtStatus *))(absent);
      k->rows_a = 0;
    }
  }
  if (!st && (k->rows_a < 0 || k->rows_a % Q4_TILE))
    st = status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: rows_a must be a multiple of 8");
  if (!st && (k->K <= 0 || k->N <= 0 || k->K % Q4_BLOCK || k->N % Q4_TILE || k->K > (1 << 20) || k->N > (1 << 24)))
    st = status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: K must be a positive multiple of 32 and N of 8");
  if (!st && k->bits != 4 && k->bits != 8) st = status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: bits must be 4 or 8");
  int64_t layout = 1;
  if (!st) {
    OrtStatus *absent = FN(S_KernelInfoGetAttribute_int64, GetInt)(info, "layout", &layout);
    if (absent) { /* no layout attribute: layout 1 */
      FN(S_ReleaseStatus, void (*)(OrtStatus *))(absent);
      layout = 1;
    }
  }
  if (!st && layout != 1 && layout != 2)
    st = status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: layout must be 1 or 2 (a graph from a newer llmpipe?)");
  if (!st && layout == 1) st = relayout(k, info);
  if (st) {
    op_destroy(k);
    return st;
  }
  k->threads = ((const RegisteredOp *)op)->threads;
  *out = k;
  return NULL;
}

/* the dims of input `i` (at most 8) and its element count */
static OrtStatus *input(OrtKernelContext *ctx, size_t i, const OrtValue **v, int64_t *dims, size_t *rank,
                        size_t *count) {
  TRY(FN(S_KernelContext_GetInput, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **))(ctx, i, v));
  if (!*v) return status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: an input it needs is missing (QA, DA, MA go together)");
  OrtTensorTypeAndShapeInfo *info;
  TRY(FN(S_GetTensorTypeAndShape, OrtStatus *(*)(const OrtValue *, OrtTensorTypeAndShapeInfo **))(*v, &info));
  OrtStatus *st = FN(S_GetDimensionsCount, OrtStatus *(*)(const OrtTensorTypeAndShapeInfo *, size_t *))(info, rank);
  if (!st && *rank > 8) st = status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: an input of rank above 8");
  if (!st)
    st = FN(S_GetDimensions, OrtStatus *(*)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t))(info, dims, *rank);
  if (!st)
    st = FN(S_GetTensorShapeElementCount, OrtStatus *(*)(const OrtTensorTypeAndShapeInfo *, size_t *))(info, count);
  FN(S_ReleaseTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo *))(info);
  return st;
}

static OrtStatus *data(const OrtValue *v, void **p) {
  return FN(S_GetTensorMutableData, OrtStatus *(*)(OrtValue *, void **))((OrtValue *)v, p);
}

static OrtStatus *count_of(const OrtValue *v, size_t *count) {
  OrtTensorTypeAndShapeInfo *info;
  TRY(FN(S_GetTensorTypeAndShape, OrtStatus *(*)(const OrtValue *, OrtTensorTypeAndShapeInfo **))(v, &info));
  OrtStatus *st =
      FN(S_GetTensorShapeElementCount, OrtStatus *(*)(const OrtTensorTypeAndShapeInfo *, size_t *))(info, count);
  FN(S_ReleaseTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo *))(info);
  return st;
}

typedef struct {
  int M, K, N, bits, tiles, chunk;
  const uint8_t *q;
  const uint16_t *d, *m;
  const int8_t *xq;
  const float *sx, *xs;
  float *y;
} Job;

static void run_chunk(void *p, size_t i) {
  const Job *j = p;
  const int t0 = (int)i * j->chunk, t1 = t0 + j->chunk < j->tiles ? t0 + j->chunk : j->tiles;
  q4_tiles(j->M, j->K, j->N, j->bits, j->q, j->d, j->m, j->xq, j->sx, j->xs, j->y, t0, t1);
}

static OrtStatus *op_compute(void *kp, OrtKernelContext *ctx) {
  const Kernel *k = kp;
  const int K = (int)k->K, N = (int)k->N, bits = (int)k->bits, nb = K / Q4_BLOCK, tiles = N / Q4_TILE;
  const OrtValue *a, *w[6] = {0};
  int64_t dims[8], wd[8];
  size_t rank, count, wrank, wcount, inputs;
  TRY(FN(S_KernelContext_GetInputCount, OrtStatus *(*)(const OrtKernelContext *, size_t *))(ctx, &inputs));
  TRY(input(ctx, 0, &a, dims, &rank, &count));
  const int KA = rank >= 1 ? (int)dims[rank - 1] : -1, R = K - KA; /* R > 0: the adapter's rows */
  const int lora = inputs >= 7;
  if (inputs > 4 && !lora) return status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: QA, DA and MA go together");
  if (lora ? (KA <= 0 || KA % Q4_BLOCK || R <= 0 || R % Q4_BLOCK) : KA != K)
    return status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: A's last dim is not K (or, with an adapter, K less its rows)");
  const size_t want[6] = {(size_t)tiles * nb * 32 * bits, (size_t)tiles * nb * 8, (size_t)tiles * nb * 8,
                          lora ? (size_t)(R / 8) * (KA / 32) * 256 : 0, lora ? (size_t)(R / 8) * (KA / 32) * 8 : 0,
                          lora ? (size_t)(R / 8) * (KA / 32) * 8 : 0};
  void *wp[6] = {0}, *ap, *yp;
  for (int i = 0; i < (lora ? 6 : 3); i++) {
    TRY(input(ctx, 1 + i, &w[i], wd, &wrank, &wcount));
    if (wcount != want[i]) return status(ORT_INVALID_ARGUMENT, "llmpipe.Q4Gemv: a weight input's size does not fit K, N");
    TRY(data(w[i], &wp[i]));
    if (k->own[i]) wp[i] = k->own[i]; /* a layout-1 graph's weights, rewritten at creation */
  }
  TRY(data(a, &ap));
  dims[rank - 1] = N;
  OrtValue *y;
  TRY(FN(S_KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(
      ctx, 0, dims, rank, &y));
  TRY(data(y, &yp));
  const size_t M = count / (size_t)KA;
  if (M == 0) return NULL;
  /* the activation rows as q4_quant_row leaves them, back to back, K wide (with an adapter: A's KA, then the
   * R values of A . A_lora^T) */
  int8_t *xq = malloc(M * (size_t)K);
  float *sx = malloc(M * nb * sizeof(float)), *xs = malloc(M * nb * sizeof(float));
  float *xa = lora ? malloc(M * (size_t)R * sizeof(float)) : NULL;
  if (!xq || !sx || !xs || (lora && !xa)) {
    free(xq), free(sx), free(xs), free(xa);
    return status(ORT_FAIL, "llmpipe.Q4Gemv: out of memory for the activation buffer");
  }
  const float *x = ap;
  for (size_t r = 0; r < M; r++) q4_quant_row(x + r * KA, KA, xq + r * (size_t)K, sx + r * nb, xs + r * nb);
  if (lora) { /* the adapter's product from the same quantised rows (R is small: one thread), then its rows;
              * the rows past rows_a are the padding to whole blocks (zero in A and in B): not computed */
    const int ra = k->rows_a > 0 && k->rows_a < R ? (int)k->rows_a : R;
    if (ra < R) memset(xa, 0, M * (size_t)R * sizeof(float));
    q4_tiles_strided((int)M, KA, R, 8, wp[3], wp[4], wp[5], xq, (size_t)K, sx, xs, nb, xa, 0, ra / Q4_TILE);
    const int nba = KA / Q4_BLOCK;
    for (size_t r = 0; r < M; r++)
      q4_quant_row(xa + r * R, R, xq + r * (size_t)K + (size_t)KA, sx + r * nb + nba, xs + r * nb + nba);
  }
  /* One chunk of tiles per thread when the session's thread count is known, each at least 32 KB of weights
   * (a smaller matrix: fewer chunks); else chunks of 256 KB. Measured on SmolLM2-135M at 2 threads (an AMD Zen
   * 2): chunks of 16 KB 145 tok/s, 64 KB 143, 256 KB 151 (the pool's cost per chunk is the price of more). */
  const size_t tile_bytes = (size_t)nb * (32 * bits + 32), bytes = tile_bytes * tiles;
  size_t parts = k->threads > 0 ? bytes / 32768 : bytes / 262144;
  if (k->threads > 0 && parts > (size_t)k->threads) parts = (size_t)k->threads;
  parts = parts < 1 ? 1 : parts;
  const int chunk = (int)((tiles + parts - 1) / parts);
  Job job = {(int)M, K, N, bits, tiles, chunk, wp[0], wp[1], wp[2], xq, sx, xs, yp};
  const size_t chunks = (size_t)(tiles + chunk - 1) / chunk;
  OrtStatus *st = NULL;
  if (chunks > 1)
    st = FN(S_KernelContext_ParallelFor, OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t,
                                                         size_t, void *))(ctx, run_chunk, chunks, 0, &job);
  else
    run_chunk(&job, 0);
  free(xq), free(sx), free(xs), free(xa);
  return st;
}

static OrtCustomOp the_op = {
    .version = OP_VERSION,
    .GetName = op_name,
    .GetExecutionProviderType = op_ep,
    .GetInputType = op_input_type,
    .GetInputTypeCount = op_input_count,
    .GetOutputType = op_output_type,
    .GetOutputTypeCount = op_output_count,
    .KernelDestroy = op_destroy,
    .GetInputCharacteristic = op_input_kind,
    .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = op_mem_default,
    .GetVariadicInputMinArity = op_one,
    .GetVariadicInputHomogeneity = op_one,
    .GetVariadicOutputMinArity = op_one,
    .GetVariadicOutputHomogeneity = op_one,
    .CreateKernelV2 = op_create,
    .KernelComputeV2 = op_compute,
};

/* The domains and ops made so far: onnxruntime keeps a pointer to each for the life of the sessions using it. */
static OrtCustomOpDomain *domains[256];
static RegisteredOp ops[256];
static int ndomains;

/* the session config entry llmpipe.infer.native.register sets: the session's intra-op threads */
static int session_threads(const OrtSessionOptions *options) {
  int has = 0;
  OrtStatus *st = FN(S_HasSessionConfigEntry, OrtStatus *(*)(const OrtSessionOptions *, const char *, int *))(
      options, "llmpipe.q4.threads", &has);
  if (st || !has) {
    if (st) FN(S_ReleaseStatus, void (*)(OrtStatus *))(st);
    return 0;
  }
  char buf[16];
  size_t size = sizeof buf;
  st = FN(S_GetSessionConfigEntry, OrtStatus *(*)(const OrtSessionOptions *, const char *, char *, size_t *))(
      options, "llmpipe.q4.threads", buf, &size);
  if (st) {
    FN(S_ReleaseStatus, void (*)(OrtStatus *))(st);
    return 0;
  }
  const int t = atoi(buf);
  return t > 0 && t <= 4096 ? t : 0;
}

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                     const OrtApiBase *base) {
  const OrtApiTable *t = base->GetApi(API_VERSION);
  if (!t) return NULL; /* an onnxruntime older than 1.20: the session then fails naming the op it lacks */
  api = t;
  const char *build = FN(S_GetBuildInfoString, const char *(*)(void))();
  if (!build || strncmp(build, "ORT Build Info", 14) != 0)
    return status(ORT_FAIL, "llmpipe.Q4Gemv: this onnxruntime's API table is not the layout the library was "
                            "written for (GetBuildInfoString's slot)");
  if (ndomains == (int)(sizeof domains / sizeof *domains))
    return status(ORT_FAIL, "llmpipe.Q4Gemv: registered in too many session options in one process");
  OrtCustomOpDomain *domain;
  TRY(FN(S_CreateCustomOpDomain, OrtStatus *(*)(const char *, OrtCustomOpDomain **))("llmpipe", &domain));
  RegisteredOp *op = &ops[ndomains];
  op->op = the_op;
  op->threads = session_threads(options);
  domains[ndomains++] = domain;
  TRY(FN(S_CustomOpDomain_Add, OrtStatus *(*)(OrtCustomOpDomain *, const OrtCustomOp *))(domain, &op->op));
  return FN(S_AddCustomOpDomain, OrtStatus *(*)(OrtSessionOptions *, OrtCustomOpDomain *))(options, domain);
}
