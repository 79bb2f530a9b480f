// specplay: a replayed chain round's bookkeeping (loaded by kernels/step.py after the decode kernels).
//
// A captured round (engine/round_graph.py) feeds itself: the last round's outcome becomes the next block, and
// the new outcome the next replay's inputs.  Written op by op that was a dozen small torch kernels a round
// (cats, adds, an embedding, copies, n-gram's cut), each a few microseconds in a replayed graph on a small
// model; these do it in one launch each.  Twins: kernels/step.py (chain_block_reference, chain_commit_reference,
// chain_limit_reference); fuzz tests in tests/test_step_kernels_gpu.py.

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

// After the verification and the readout: the next replay's inputs.  accepted = accepted_in, next_token =
// max(next_in, 0) (-1 flags NaN, which the readout reports), draft [K] = chain, start = start_in, and where
// count is not NULL, count_out[0] = count[0] as a float (n-gram's count of real drafts, the readout's last
// value).  One block.
extern "C" __global__ void sp_chain_commit(const long long* accepted_in, const long long* next_in,
                                           const long long* chain, int K, const long long* start_in,
                                           const long long* count, long long* accepted, long long* next_token,
                                           long long* draft, long long* start, float* count_out) {
    sp_let_next_start();
    sp_wait_for_previous();
    for (int j = threadIdx.x; j < K; j += blockDim.x) draft[j] = chain[j];
    if (threadIdx.x == 0) {
        accepted[0] = accepted_in[0];
        next_token[0] = max(next_in[0], 0LL);
        start[0] = start_in[0];
        if (count != nullptr) count_out[0] = (float)count[0];
    }
}

// A greedy chain verification's result cut at the count of real drafts (n-gram: the lookup found `count` of
// the K slots), in place: accepted = min(accepted, count); where more were accepted and the next token is not
// the NaN flag, the next token is the chain's token at the cut (the target's argmax there, which it matched);
// path[j] = -1 from the new accepted count on; tested[j] only below count.  One block.
extern "C" __global__ void sp_chain_limit(long long* accepted, long long* next_token, long long* path,
                                          unsigned char* tested, const long long* chain, int K,
                                          const long long* count) {
    sp_let_next_start();
    sp_wait_for_previous();
    long long was = accepted[0], real = count[0], next = next_token[0];
    long long kept = min(was, real);
    __syncthreads();  // every thread has read the result before it changes
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
        if (j >= kept) path[j] = -1;
        if (j >= real) tested[j] = 0;
    }
    if (threadIdx.x == 0) {
        accepted[0] = kept;
        if (was > real && next >= 0) next_token[0] = chain[min(real, (long long)K - 1)];
    }
}
