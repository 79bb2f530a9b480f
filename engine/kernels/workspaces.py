"""The scratch memory of the verification kernels (sp_verify) and of sp_wide, one set per CUDA stream.

A workspace grows, never shrinks, and one that a bigger one replaced is kept allocated: a CUDA graph
captured while it was current launches its kernels with its address, so freeing it would let a later replay
write into memory another tensor owns (an illegal address on an H200, in a sampled K sweep whose larger K
outgrew the workspace its smaller K's round graphs were captured with). Pure torch, so that the CPU tests
check the bookkeeping.
"""
from __future__ import annotations

import torch

from engine.kernels.launch_spec import row_stats_bytes, wide_sync_words, wide_workspace_bytes


class VerifyWorkspace:
    """sp_verify's scratch: a RowStats per row, a completion counter per sequence (zeroed; the kernel leaves
    it zeroed) and a residual row per sequence."""

    def __init__(self, device: torch.device, rows: int, batch: int, vocab_batch: int):
        self.rows, self.batch, self.vocab_batch = rows, batch, vocab_batch
        self.stats = torch.empty(row_stats_bytes(rows), dtype=torch.uint8, device=device)
        self.counters = torch.zeros(batch, dtype=torch.int32, device=device)
        self.scratch = torch.empty(vocab_batch, dtype=torch.float32, device=device)
        self.stats_ptr = self.stats.data_ptr()
        self.counters_ptr = self.counters.data_ptr()
        self.scratch_ptr = self.scratch.data_ptr()


class WideWorkspace:
    """sp_wide's `ws` (bytes) and `sync` (zeroed; the kernel leaves it zeroed), for `batch` sequences."""

    def __init__(self, device: torch.device, nbytes: int, batch: int):
        self.nbytes, self.batch = nbytes, batch
        self.ws = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.sync = torch.zeros(wide_sync_words(batch), dtype=torch.int32, device=device)
        self.ws_ptr = self.ws.data_ptr()
        self.sync_ptr = self.sync.data_ptr()


class Workspaces:
    def __init__(self, device: torch.device):
        self.device = device
        self.current_verify: dict = {}  # stream pointer -> VerifyWorkspace
        self.current_wide: dict = {}  # stream pointer -> WideWorkspace
        self.outgrown: list = []  # replaced workspaces, kept for the graphs captured with them

    def verify(self, stream_ptr: int, rows: int, batch: int, vocab: int) -> VerifyWorkspace:
        vocab_batch = batch * vocab
        ws = self.current_verify.get(stream_ptr)
        if ws is None or ws.rows < rows or ws.batch < batch or ws.vocab_batch < vocab_batch:
            if ws is not None:
                rows, batch, vocab_batch = (max(rows, ws.rows), max(batch, ws.batch),
                                            max(vocab_batch, ws.vocab_batch))
                self.outgrown.append(ws)
            ws = self.current_verify[stream_ptr] = VerifyWorkspace(self.device, rows, batch, vocab_batch)
        return ws

    def wide(self, stream_ptr: int, batch: int, rows_per_seq: int, chunks: int) -> WideWorkspace:
        nbytes = wide_workspace_bytes(batch, rows_per_seq, chunks)
        ws = self.current_wide.get(stream_ptr)
        if ws is None or ws.nbytes < nbytes or ws.batch < batch:
            if ws is not None:
                nbytes, batch = max(nbytes, ws.nbytes), max(batch, ws.batch)
                self.outgrown.append(ws)
            ws = self.current_wide[stream_ptr] = WideWorkspace(self.device, nbytes, batch)
        return ws
