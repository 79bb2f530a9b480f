"""A batched forward for B sequences that share one LlamaRunner's weights, each at its own length.

Why a separate runner: the single-sequence LlamaRunner keeps one cache and one length; batched decoding needs
B caches that grow and roll back independently (ragged acceptance), with every sequence's block written at its
own positions. The weights (the runner's _Layer objects, embedding, final norm, LM head, rope tables) are used
as they are: nothing is copied.

Cache layout: `kv` [layers, 2, B, kv_heads, max_length, head_dim]; row r of sequence b holds b's token at
cache index r. Lengths live on the host (the round loop reads each round's outcome anyway); a step gets them
as a device tensor `start` [B], so the step itself never waits for the host and, for a fixed (n, kv), is
captured in a CUDA graph on GPU (CapturedBatchStep).

A block is n tokens per sequence, right-padded: `counts[b]` <= n of them are real and the length of b grows by
counts[b]. Padded tokens sit after the real ones, so causal attention keeps them out of the real tokens'
outputs; their K/V land in rows past the new length, which the mask hides and later blocks overwrite.
`forward_embeds` appends a block of input vectors [B, n, H] instead of token ids (the EAGLE head's fused
inputs)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.models.llama import (
    DECODE_ROWS,
    GRAPH_MAX_BLOCK,
    LlamaRunner,
    _add_linear_,
    _linear_residual,
    apply_rope,
    norm_heads,
    rms_norm,
)
from engine.models.runner import captured, graph_capture, to_device, warm_up_stream

KV_ALIGN = 64  # on GPU the cache length is rounded up to this many rows (an aligned attention mask)
GRAPH_LIMIT = 32  # captured steps kept per batch runner; past this, new shapes run eagerly


class BatchRunner:
    """B sequences over one LlamaRunner's weights; chains only."""

    def __init__(self, runner: LlamaRunner, batch: int, max_length: int):
        if batch < 1:
            raise SpecplayError(f"batch must be >= 1 (got {batch})")
        self.runner = runner
        self.spec = runner.spec
        self.device, self.dtype = runner.device, runner.dtype
        self.batch = int(batch)
        self.vocab_size = runner.vocab_size
        if max_length > runner.max_length:  # the rope tables cover runner.max_length positions
            raise SpecplayError(f"batched context of {max_length} tokens exceeds the model's "
                                f"{runner.max_length}")
        if self.device.type == "cuda":
            max_length = min(runner.max_length, -(-max_length // KV_ALIGN) * KV_ALIGN)
        self.max_length = int(max_length)
        s = self.spec
        shape = (s.num_layers, 2, self.batch, s.num_kv_heads, self.max_length, s.head_dim)
        self.kv = torch.zeros(shape, device=self.device, dtype=self.dtype)  # [L, 2, B, kvh, max_length, D]
        self._rows = torch.arange(self.batch, device=self.device)  # [B]
        self._arange = torch.arange(self.max_length, device=self.device)  # [max_length]
        self.lengths: List[int] = [0] * self.batch
        self.use_graphs = self.device.type == "cuda"
        self._graphs: Dict[tuple, "CapturedBatchStep"] = {}
        self.pool_handle = None

    # -- lengths ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.lengths = [0] * self.batch

    def rollback(self, b: int, length: int) -> None:
        """Forget sequence b's cached tokens at index >= length."""
        if not 0 <= length <= self.lengths[b]:
            raise ValueError(f"rollback of sequence {b} to {length}: "
                             f"its cache holds {self.lengths[b]} tokens")
        self.lengths[b] = int(length)

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Roll every sequence back at once (each length <= its current one)."""
        for b, length in enumerate(lengths):
            self.rollback(b, length)

    # -- forward ---------------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, counts: Optional[Sequence[int]] = None, with_logits: bool = True):
        """Append a block tokens [B, n] (int64, right-padded) at each sequence's own length.

        counts: real tokens per sequence (default n each; 0 leaves a sequence untouched, e.g. a finished one).
        Returns (logits [B, n, V] float32, features [B, n, H]); rows past counts[b] are padding.
        with_logits=False skips the LM head (a prefill: [B, P, V] logits nobody reads): logits None."""
        return self._append(tokens.to(self.device), counts, with_logits, embeds=False)

    def forward_embeds(self, inputs: torch.Tensor, counts: Optional[Sequence[int]] = None):
        """Like forward, from input vectors inputs [B, n, H] instead of token ids (the EAGLE head feeds fused
        features and token embeddings). Returns (logits [B, n, V] float32, features [B, n, H])."""
        return self._append(inputs.to(self.device, self.dtype), counts, True, embeds=True)

    def _append(self, block: torch.Tensor, counts: Optional[Sequence[int]], with_logits: bool, embeds: bool):
        """forward / forward_embeds: block [B, n] token ids or [B, n, H] input vectors (embeds)."""
        n = block.shape[1]
        counts = [n] * self.batch if counts is None else [int(c) for c in counts]
        top = max(self.lengths) + n
        if top > self.max_length:
            raise SpecplayError(f"context full: {max(self.lengths)} cached + {n} new tokens exceed the "
                                f"batched max_length {self.max_length}")
        kv = self.kv_width(top)
        captured = self._captured_step(n, kv, embeds=embeds) if with_logits else None
        start = to_device(self.lengths, self.device)  # [B]
        if captured is not None:
            logits, hidden = captured.run(block, start)
        elif embeds:
            logits, hidden = self.step_embeds(block, start, kv)
        else:
            logits, hidden = self.step(block, start, kv, with_logits)
        self.lengths = [length + c for length, c in zip(self.lengths, counts, strict=True)]
        return logits, hidden

    def step(self, tokens: torch.Tensor, start: torch.Tensor, kv: int, with_logits: bool = True):
        """tokens [B, n] at rows start[b]..start[b]+n-1 -> (logits [B, n, V] float32, features [B, n, H]).
        Device tensors only, so that the CUDA graph captures exactly this."""
        x = F.embedding(tokens, self.runner.embed_weight)  # [B, n, H]
        return self._step(x, start, kv, with_logits)

    def step_embeds(self, x: torch.Tensor, start: torch.Tensor, kv: int):
        """step from input vectors x [B, n, H] (captured by CapturedBatchStep like step)."""
        return self._step(x, start, kv, True)

    def _step(self, x: torch.Tensor, start: torch.Tensor, kv: int, with_logits: bool):
        """x [B, n, H] at rows start[b]..start[b]+n-1 -> (logits [B, n, V] float32 or None, features
        [B, n, H])."""
        bsz, n = x.shape[:2]
        offsets = self._arange[:n]  # [n]
        positions = start[:, None] + offsets[None, :]  # [B, n]
        decode = self.decode_path(n)
        if decode:
            hidden = self._decode_layers(x.reshape(bsz * n, -1), positions, start)  # [B n, H]
        else:
            hidden = self._layers(x.reshape(bsz * n, -1), positions, self._mask(start, offsets, kv))
        if not with_logits:
            return None, hidden.view(bsz, n, -1)
        if decode:
            r = self.runner
            logits = r.project(r.block_norm(hidden, r.norm_weight))
        else:
            logits = self.runner.logits_from_hidden(hidden)  # [B n, V]
        return logits.view(bsz, n, -1), hidden.view(bsz, n, -1)

    def _mask(self, start: torch.Tensor, offsets: torch.Tensor, kv: int) -> torch.Tensor:
        """Additive float mask [B, n, kv]: query i of sequence b sees every cached row (col < start[b]) and
        block rows up to itself."""
        cols = self._arange[:kv]  # [kv]
        # query i of sequence b sees every cached row (col < start) and block rows up to itself
        visible = (cols[None, None, :] - start[:, None, None]) <= offsets[None, :, None]  # [B, n, kv]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, float("-inf"))

    def decode_path(self, n: int) -> bool:
        """Whether blocks of n take the decode kernels (engine.models.llama's: bf16/fp16 on CUDA, n <=
        DECODE_ROWS):
        rope + cache write in one kernel and the attention kernel over every sequence's own cache rows, in
        place of rope, indexed cache writes, the mask and SDPA over the whole padded cache."""
        return self.runner.decode_kernels is not None and n <= DECODE_ROWS

    def _decode_layers(self, x: torch.Tensor, positions: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The decoder stack on the decode kernels: x [B n, H] at rows positions [B, n] (start [B] on the
        device) -> features [B n, H]. The products stay cuBLAS's (B n rows), each residual added in place by
        its GEMM; the norms LlamaRunner.block_norm's."""
        s, r = self.spec, self.runner
        k = r.decode_kernels
        bsz, n = positions.shape
        # token (b, i)'s cache row as the rope kernel addresses B caches [B, kvh, max_length, D]
        cache_index = (self._rows[:bsz, None] * (s.num_kv_heads * self.max_length) + positions).reshape(-1)
        flat_positions = positions.reshape(-1)  # [B n]
        chain = r.chain_block(n)[1]  # [n, n] bool: token i sees block rows 0..i
        x = x.clone(memory_format=torch.contiguous_format)  # the residual adds write into x
        for li, layer in enumerate(r.layers):
            keys, values = self.kv[li, 0, :bsz], self.kv[li, 1, :bsz]  # [B, kvh, max_length, D] each
            qkv = F.linear(r.block_norm(x, layer.ln1), layer.w_qkv, layer.b_qkv)  # [B n, (heads + 2 kvh) D]
            qkv = norm_heads(qkv, layer, s)  # Qwen3's per-head norms of q and k, before rope
            cos_table, sin_table = r.rope_tables()
            q = k.rope_qkv(qkv, cos_table, sin_table, flat_positions, cache_index, keys, values,
                           s.num_heads, s.num_kv_heads)  # [heads, B n, D]
            # [B n, heads D] (after rope)
            attn = k.attention(q, keys, values, start, chain, chained=True, wide=True)
            x = _add_linear_(x, attn, layer.w_o, layer.b_o)
            gate_up = F.linear(r.block_norm(x, layer.ln2), layer.w_gate_up, layer.b_gate_up)
            x = _add_linear_(x, k.silu_mul(gate_up), layer.w_down, layer.b_down)
        return x

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The decoder stack on x [B n, H]; writes each layer's K/V at rows `positions` [B, n] of each
        sequence.
        mask: [B, n, kv] additive float. Returns features [B n, H] (pre-norm)."""
        s, r = self.spec, self.runner
        bsz, n = positions.shape
        group = s.num_heads // s.num_kv_heads
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        cos_table, sin_table = r.rope_tables()
        # [B, n, 1, D] each
        cos, sin = cos_table[positions][:, :, None], sin_table[positions][:, :, None]
        # [B, 1, group n, kv]: row g n + i is query i of group member g (GQA folded into the rows)
        mask_g = mask.repeat(1, group, 1)[:, None]
        kv = mask.shape[-1]
        seq = self._rows[:bsz, None].expand(bsz, n)  # [B, n]
        for li, layer in enumerate(r.layers):
            h = rms_norm(x, layer.ln1, s.rms_norm_eps)
            qkv = norm_heads(F.linear(h, layer.w_qkv, layer.b_qkv), layer, s)  # [B n, (heads + 2 kvh) D]
            qkv = qkv.view(bsz, n, -1)  # [B, n, (heads + 2 kvh) D]
            qk = qkv[..., :q_dim + kv_dim].unflatten(-1, (-1, s.head_dim))  # [B, n, heads + kvh, D]
            qk = apply_rope(qk, cos, sin)
            k = qk[:, :, s.num_heads:]  # [B, n, kvh, D]
            v = qkv[..., q_dim + kv_dim:].unflatten(-1, (s.num_kv_heads, s.head_dim))  # [B, n, kvh, D]
            # cache [B, kvh, max_length, D] indexed at ([B, n], :, [B, n]) is [B, n, kvh, D], like k and v
            self.kv[li, 0][seq, :, positions] = k
            self.kv[li, 1][seq, :, positions] = v
            keys, values = self.kv[li, 0, :bsz, :, :kv], self.kv[li, 1, :bsz, :, :kv]  # [B, kvh, kv, D]
            q = qk[:, :, :s.num_heads].transpose(1, 2)  # [B, heads, n, D]
            qg = q.reshape(bsz, s.num_kv_heads, group * n, s.head_dim)  # [B, kvh, group n, D]
            attn = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask_g)  # like qg
            attn = attn.reshape(bsz, s.num_heads, n, s.head_dim).transpose(1, 2).reshape(bsz * n, q_dim)
            x = _linear_residual(x, attn, layer.w_o, layer.b_o)
            h = rms_norm(x, layer.ln2, s.rms_norm_eps)
            gate, up = F.linear(h, layer.w_gate_up, layer.b_gate_up).chunk(2, dim=-1)  # [B n, I] each
            x = _linear_residual(x, F.silu(gate) * up, layer.w_down, layer.b_down)
        return x

    # -- CUDA graphs -----------------------------------------------------------------------------------------

    def kv_width(self, rows: int) -> int:
        """Cache rows a step attends over: the whole (aligned) cache on GPU, so that one captured graph per
        block size serves a whole generation (a capture in the middle of a timed run would cost more than the
        rows it saves: a batched cache is short, the longest prompt + the budget); exactly `rows` on CPU."""
        return self.max_length if self.device.type == "cuda" else rows

    def _captured_step(self, n: int, kv: int, embeds: bool = False) -> Optional["CapturedBatchStep"]:
        """The captured step for blocks of n at attention width kv (of input vectors when embeds); None runs
        eagerly (CPU, prefills, and shapes past GRAPH_LIMIT)."""
        if not self.use_graphs or n > GRAPH_MAX_BLOCK or min(self.lengths) == 0:
            return None
        key = (n, kv, embeds)
        if key not in self._graphs:
            if len(self._graphs) >= GRAPH_LIMIT:
                return None
            graph = captured(self, lambda: CapturedBatchStep(self, n, kv, self._pool(), embeds),
                             "batched step")
            if graph is None:
                return None
            self._graphs[key] = graph
        return self._graphs[key]

    def _pool(self):
        if self.pool_handle is None:
            self.pool_handle = torch.cuda.graph_pool_handle()
        return self.pool_handle

    def release_graphs(self) -> None:
        self._graphs.clear()
        self.pool_handle = None


class CapturedBatchStep:
    """BatchRunner.step (or step_embeds when embeds) for a fixed (n, kv), captured as a CUDA graph (see
    engine.models.llama.CapturedStep).

    The warm-up and the capture write K/V at rows lengths..lengths+n-1 of each sequence: free rows (the
    capture happens before the real step, which writes the same rows next). Outputs are cloned after each
    replay, since graphs share one memory pool."""

    def __init__(self, runner: BatchRunner, n: int, kv: int, pool, embeds: bool = False):
        device = runner.device
        if embeds:  # [B, n, H] input vectors
            self.tokens = torch.zeros(runner.batch, n, runner.runner.hidden_size, dtype=runner.dtype,
                                      device=device)
        else:  # [B, n] token ids
            self.tokens = torch.zeros(runner.batch, n, dtype=torch.long, device=device)
        self.start = to_device(runner.lengths, device)  # [B]

        def body():
            if embeds:
                return runner.step_embeds(self.tokens, self.start, kv)
            return runner.step(self.tokens, self.start, kv)

        with warm_up_stream(device):
            body()  # warm-up outside the capture (cuBLAS handles, workspaces)
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph, pool, device):
            self.logits, self.hidden = body()  # [B, n, V], [B, n, H]

    def run(self, tokens: torch.Tensor, start: torch.Tensor):
        self.tokens.copy_(tokens)
        self.start.copy_(start)
        self.graph.replay()
        return self.logits.clone(), self.hidden.clone()
