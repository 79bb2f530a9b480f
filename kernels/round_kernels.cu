// specplay: a replayed chain round's bookkeeping (loaded by kernels/step.py after the decode kernels).
//
// A captured round (engine/round_graph.py) feeds itself: the last round's outcome becomes the next block, and
// the new outcome the next replay's inputs.  Written op by op that was a dozen small torch kernels a round
// (cats, adds, an embedding, copies), each a few microseconds in a replayed graph on a small
// model; these do it in one launch each.  Twins: kernels/step.py (chain_block_reference, chain_commit_reference); fuzz tests in tests/test_step_kernels_gpu.py.

// The block a chain round verifies: tokens_out [K+1] = [next_token, chain], start_out = start + 1 + accepted
// (the block after the last one's accepted rows), x_out [K+1, H] = embed[tokens_out] (embed [V, H]).
// One thread per value of x_out.
template <typename T>
__global__ void sp_chain_block(const long long* next_token, const long long* chain, int K, const long long* start,
                               const long long* accepted, const T* embed, int H, long long* tokens_out,
                               long long* start_out, T* x_out) {
    sp_let_next_start();
    sp_wait_for_previous();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)(K + 1) * H) return;
    int i = (int)(idx / H), c = (int)(idx - (long long)i * H);
    long long token = i == 0 ? next_token[0] : chain[i - 1];
    x_out[idx] = embed[token * H + c];
    if (c == 0) tokens_out[i] = token;
    if (idx == 0) start_out[0] = start[0] + 1 + accepted[0];
}

// After the verification and the readout: the next replay's inputs.  accepted = max(accepted_in, 0) and
// next_token = max(next_in, 0) (-1 flags NaN, which the readout reports), draft [K] = chain, start = start_in, and where
// count is not NULL, count_out[0] = count[0] as a float (n-gram's count of real drafts, the readout's last
// value), and path [P] = path_in (a tree round's accepted path, Medusa's; P = 0 without one).  One block.
extern "C" __global__ void sp_chain_commit(const long long* accepted_in, const long long* next_in,
                                           const long long* chain, int K, const long long* start_in,
                                           const long long* count, long long* accepted, long long* next_token,
                                           long long* draft, long long* start, float* count_out,
                                           const long long* path_in, long long* path, int P) {
    sp_let_next_start();
    sp_wait_for_previous();
    for (int j = threadIdx.x; j < K; j += blockDim.x) draft[j] = chain[j];
    for (int j = threadIdx.x; j < P; j += blockDim.x) path[j] = path_in[j];
    if (threadIdx.x == 0) {
        accepted[0] = max(accepted_in[0], 0LL);
        next_token[0] = max(next_in[0], 0LL);
        start[0] = start_in[0];
        if (count != nullptr) count_out[0] = (float)count[0];
    }
}

// EAGLE's tree growth (engine/drafters/eagle.py _grow_tree): one level's choice of nodes and the round's final
// choice, one block each.  Written op by op they were some fifteen small torch kernels a level and a dozen
// for the choice, each a few microseconds in a replayed graph on a small model.  Twins: kernels/step.py
// (tree_level_reference, tree_choose_reference); fuzz tests in tests/test_step_kernels_gpu.py.
#define SP_TREE_MAX 64  // the most candidates a level ranks, and the most nodes a growth has

// sp_topk's order: a (index ia) comes before b (index ib): values descending, a tie to the lower index, NaN
// above everything.
__device__ __forceinline__ bool sp_ranks_before(float a, int ia, float b, int ib) {
    bool a_nan = isnan(a), b_nan = isnan(b);
    if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
    return a > b || (a == b && ia < ib);
}

// One level: candidate c = f * B + b (F frontier nodes, their B best children) scores frontier_scores[f] +
// top_values[c]; the W best in sp_topk's order become nodes count..count+W-1 of the growth's T: their tokens
// (top_indices[c]), parents (frontier[f]) and scores, their ancestor-or-self rows of ancestors [T, T] (0/1, in
// place: the parent's row and the node itself), and for the next level local_parent [W] (f), positions [W]
// (true_length + the node's depth), frontier_out [W] (the nodes) and frontier_scores_out [W].  One block.
extern "C" __global__ void sp_tree_level(const float* top_values, const long long* top_indices,
                                         const float* frontier_scores, const long long* frontier, int F, int B,
                                         int W, int count, int T, unsigned char* ancestors,
                                         const long long* node_depth, const long long* true_length,
                                         long long* tokens_all, long long* parents_all, float* scores_all,
                                         long long* local_parent, long long* positions,
                                         long long* frontier_out, float* frontier_scores_out) {
    sp_let_next_start();
    sp_wait_for_previous();
    __shared__ float score[SP_TREE_MAX];
    __shared__ int pick[SP_TREE_MAX];  // rank -> candidate
    const int C = F * B;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        score[c] = __fadd_rn(frontier_scores[c / B], top_values[c]);
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        int rank = 0;
        for (int j = 0; j < C; ++j) rank += sp_ranks_before(score[j], j, score[c], c);
        if (rank < W) pick[rank] = c;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < W; r += blockDim.x) {
        int c = pick[r], f = c / B, node = count + r;
        tokens_all[node] = top_indices[c];
        parents_all[node] = frontier[f];
        scores_all[node] = score[c];
        local_parent[r] = f;
        positions[r] = true_length[0] + node_depth[node];
        frontier_out[r] = node;
        frontier_scores_out[r] = score[c];
    }
    // rows count.. are written, rows of earlier nodes (the parents) read: never the same row
    for (int idx = threadIdx.x; idx < W * T; idx += blockDim.x) {
        int r = idx / T, j = idx - r * T, node = count + r;
        long long parent = frontier[pick[r] / B];
        ancestors[(long long)node * T + j] = (j == node) || (parent >= 0 && ancestors[parent * T + j]);
    }
}

// The round's tree: the N best of the T candidates by key = scores_all - tie_break * node_depth (sp_topk's
// order), in candidate order: tokens_out [N], parents_out [N] (a node of the tree; -1 the last committed
// token, and -1 for a parent left out, which the tie break rules out), and the verification block's depth_out
// [N+1] (0, then depth + 1) and visible_out [N+1, N+1] (column 0 set; row 0 only there; the nodes' ancestors
// among the chosen).  One block.
extern "C" __global__ void sp_tree_choose(const long long* tokens_all, const long long* parents_all,
                                          const float* scores_all, const long long* node_depth,
                                          const unsigned char* ancestors, int T, int N, float tie_break,
                                          long long* tokens_out, long long* parents_out, long long* depth_out,
                                          unsigned char* visible_out) {
    sp_let_next_start();
    sp_wait_for_previous();
    __shared__ float key[SP_TREE_MAX];
    __shared__ int chosen[SP_TREE_MAX];  // candidate -> 1 when among the N best
    __shared__ int slot[SP_TREE_MAX];    // candidate -> its node, -1 when left out
    __shared__ int pick[SP_TREE_MAX];    // node -> candidate
    for (int i = threadIdx.x; i < T; i += blockDim.x)
        key[i] = __fsub_rn(scores_all[i], __fmul_rn(tie_break, (float)node_depth[i]));
    __syncthreads();
    for (int i = threadIdx.x; i < T; i += blockDim.x) {
        int rank = 0;
        for (int j = 0; j < T; ++j) rank += sp_ranks_before(key[j], j, key[i], i);
        chosen[i] = rank < N;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < T; i += blockDim.x) {
        int place = -1;
        if (chosen[i]) {
            place = 0;
            for (int j = 0; j < i; ++j) place += chosen[j];
            pick[place] = i;
        }
        slot[i] = place;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < N; p += blockDim.x) {
        int c = pick[p];
        long long parent = parents_all[c];
        tokens_out[p] = tokens_all[c];
        parents_out[p] = parent >= 0 ? (long long)slot[parent] : parent;
        depth_out[p + 1] = node_depth[c] + 1;
    }
    if (threadIdx.x == 0) depth_out[0] = 0;
    const int R = N + 1;
    for (int idx = threadIdx.x; idx < R * R; idx += blockDim.x) {
        int a = idx / R, b = idx - a * R;
        visible_out[idx] = b == 0 ? 1 : (a == 0 ? 0 : ancestors[(long long)pick[a - 1] * T + pick[b - 1]]);
    }
}

// Medusa's heads (engine/drafters/medusa.py) on rows of a verified block's features x [rows, H] (pre-norm), in
// one launch where torch took a dozen kernels (the row's pick, the final norm, the heads' product, SiLU, the
// residual, the layout for the LM head):
//   out[d, m, j] = rnd(xn[j] + rnd(silu(rnd(W[d H + j] . xn + b[d H + j])))),   d < D, j < H,
// xn = the row's RMSNorm times norm_weight as transformers rounds it (rms_norm_reference).  Output m reads row
// m, or where accepted is not NULL (M = 1) the row that gave the last round's next token: 0 when nothing was
// accepted, else path[accepted - 1] + 1.  Twin: kernels/step.py medusa_heads_reference.  Grid
// (ceil(D H / 8), M), 256 threads: a warp per output value.  H % 8 == 0, H <= SP_MEDUSA_MAX_H.
#define SP_MEDUSA_MAX_H 8192
template <typename T>
__global__ void __launch_bounds__(256) sp_medusa_heads(const T* x, int H, const long long* accepted,
                                                       const long long* path, const T* norm_weight, float eps,
                                                       const T* weight, const T* bias, int D, int M, T* out) {
    __shared__ float xn[SP_MEDUSA_MAX_H];
    __shared__ float partial[8];
    sp_let_next_start();
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int o = blockIdx.x * 8 + warp, m = blockIdx.y;  // this warp's output value d * H + j, and output row
    int chunks = H / 8;
    sp_wait_for_previous();
    long long row = m;
    if (accepted != nullptr) {
        long long a = accepted[0];
        row = a > 0 ? path[a - 1] + 1 : 0;
    }
    const uint4* xv = reinterpret_cast<const uint4*>(x + row * H);
    float ss = 0.f;
    for (int c = tid; c < chunks; c += blockDim.x) {
        float f[8];
        dk_unpack8<T>(xv[c], f);
#pragma unroll
        for (int j = 0; j < 8; j++) ss = fmaf(f[j], f[j], ss);
    }
    ss = dk_warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < 8; w++) total += partial[w];
    float scale = rsqrtf(total / (float)H + eps);
    const uint4* nv = reinterpret_cast<const uint4*>(norm_weight);
    for (int c = tid; c < chunks; c += blockDim.x) {
        float f[8], g[8];
        dk_unpack8<T>(xv[c], f);
        dk_unpack8<T>(nv[c], g);
#pragma unroll
        for (int j = 0; j < 8; j++) xn[c * 8 + j] = to_f(rnd<T>(g[j] * to_f(rnd<T>(f[j] * scale))));
    }
    __syncthreads();
    if (o >= D * H) return;
    const uint4* wv = reinterpret_cast<const uint4*>(weight + (long long)o * H);
    float acc = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        float w8[8];
        dk_unpack8<T>(wv[c], w8);
#pragma unroll
        for (int j = 0; j < 8; j++) acc = fmaf(w8[j], xn[c * 8 + j], acc);
    }
    acc = dk_warp_sum(acc);
    if (lane == 0) {
        int d = o / H, j = o - d * H;
        float v = to_f(rnd<T>(acc + (bias != nullptr ? to_f(bias[o]) : 0.f)));
        float s = to_f(rnd<T>(v / (1.0f + expf(-v))));
        out[((long long)d * M + m) * H + j] = rnd<T>(xn[j] + s);
    }
}

// A tree block's accepted path kept in the target's cache (engine/round_graph.py keep_path): the block's row 0 at
// cache row start[0] is the last committed token, and rows start + 1 + i take rows start + 1 + path[i] for
// i < P where path[i] >= 0 (-1 past the accepted count: those rows stay).  kv holds `planes` planes (layers,
// K and V, kv heads) of max_len rows of `chunks` 16-byte chunks each; any dtype.  A thread owns one chunk column
// of one plane and reads every source before it writes, so rows moving down over each other are safe.  Where
// torch gathered and scattered in some six kernels, this is one.  Twin: kernels/step.py keep_path_reference.
#define SP_KEEP_MAX 16
extern "C" __global__ void sp_keep_path(uint4* kv, int planes, int max_len, int chunks,
                                        const long long* start, const long long* path, int P) {
    sp_let_next_start();
    sp_wait_for_previous();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)planes * chunks) return;
    long long plane = idx / chunks;
    uint4* column = kv + plane * max_len * chunks + (idx - plane * chunks);  // row r at column[r * chunks]
    long long base = start[0] + 1;
    uint4 moved[SP_KEEP_MAX];
#pragma unroll
    for (int i = 0; i < SP_KEEP_MAX; i++) {
        if (i < P && path[i] >= 0 && path[i] != i) moved[i] = column[(base + path[i]) * chunks];
    }
#pragma unroll
    for (int i = 0; i < SP_KEEP_MAX; i++) {
        if (i < P && path[i] >= 0 && path[i] != i) column[(base + i) * chunks] = moved[i];
    }
}
