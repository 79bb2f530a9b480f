"""Tensor-parallel verification: a Llama-family target split Megatron-style over N ranks (torch.distributed).

Layout of one rank's shard (world N):
  q/k/v            column-split by heads: heads/N query heads, kv_heads/N kv heads (the KV cache likewise)
  o, down          row-split: each rank's partial sums are all-reduced (LlamaRunner's `_residual_out` hook)
  gate/up          column-split by the intermediate size: I/N each
  LM head          split over the vocabulary (padded with zero rows to a multiple of N), logits all-gathered
  embedding, norms replicated

Every rank runs the same forward. Rank 0 holds the `TPRunner` the decoder and the drafters see (the
CausalRunner interface); each call that changes the cache (forward, rollback, compact, reset) is first
broadcast to the other ranks, which loop in `_serve` until told to stop. The draft model, the EAGLE / Medusa
heads and verification stay on rank 0 (rank 0 also keeps the full LM head for the heads' own projections).

Ranks are processes started with torch.multiprocessing (spawn); the process group is gloo on the CPU and NCCL
on CUDA (rank r on cuda:r), rendezvous through a FileStore in a temporary directory (no network). Only the CPU
path has been run; on CUDA the shard runs eagerly (no CUDA graphs).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.errors import SpecplayError
from engine.models.llama import (
    LlamaRunner,
    LlamaSpec,
    UnsupportedLlamaConfig,
    is_llama_family,
    spec_from_config,
)
from engine.models.runner import CausalRunner, ForwardOutput

INIT_TIMEOUT_S = 120  # rendezvous and every collective inside a forward
IDLE_TIMEOUT_S = 24 * 3600  # a worker waiting for rank 0's next command (the user may be thinking)
JOIN_TIMEOUT_S = 10
STOP, FORWARD, ROLLBACK, COMPACT, RESET = range(5)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------------------------------------
# Checks


def check_tp(tp: int, spec: LlamaSpec, device: torch.device) -> None:
    """SpecplayError (one line, exit 2) when the target cannot be split over tp ranks on this device."""
    if not isinstance(tp, int) or tp < 1:
        raise SpecplayError(f"--tp {tp}: must be at least 1")
    for what, count in (("attention heads", spec.num_heads), ("kv heads", spec.num_kv_heads),
                        ("intermediate size", spec.intermediate_size)):
        if count % tp:
            raise SpecplayError(f"--tp {tp}: the target's {count} {what} are not divisible by {tp}")
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if tp > gpus:
            raise SpecplayError(f"--tp {tp}: more ranks than GPUs ({gpus} visible)")


def target_spec(model_dir: Path) -> LlamaSpec:
    """The target's LlamaSpec; SpecplayError when it is not a model the compact Llama forward runs."""
    from engine.models.llama import read_config_json

    config = read_config_json(model_dir)
    if not is_llama_family(config):
        raise SpecplayError(f"--tp needs a Llama-family target (Llama, Qwen2, Qwen3, Mistral); "
                            f"{model_dir} is {config.get('model_type')!r}")
    try:
        return spec_from_config(model_dir, config)
    except UnsupportedLlamaConfig as exc:
        raise SpecplayError(f"--tp needs the compact Llama forward, which cannot run {model_dir}: "
                            f"{exc}") from None


# ------------------------------------------------------------------------------------------------------------
# Sharding


def vocab_shard(lm_head: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows rank*Vs..(rank+1)*Vs of the LM head [V, H], Vs = ceil(V / world); missing rows are zeros (the
    gathered logits are cut back to V)."""
    per = -(-lm_head.shape[0] // world)
    padded = F.pad(lm_head, (0, 0, 0, per * world - lm_head.shape[0]))  # [world * Vs, H]
    return padded[rank * per:(rank + 1) * per].contiguous()  # [Vs, H]


def split_of(name: str) -> str:
    """How a checkpoint tensor is split: "rows" (q/k/v, gate/up and their biases: by heads / intermediate),
    "cols" (o and down: the row-parallel inputs) or "full" (embedding, norms, o/down biases, added once after
    the all-reduce). The LM head is handled apart (vocab_shard)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return "cols"
    if name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj.bias")) \
            and not name.endswith(("o_proj.bias", "down_proj.bias")):
        return "rows"
    return "full"


def _read_slice(part, split: str, rank: int, world: int) -> torch.Tensor:
    """This rank's part of one safetensors tensor, read without the rest (a 70B checkpoint is not read
    whole by every rank)."""
    shape = part.get_shape()
    if split == "rows":
        per = shape[0] // world
        return part[rank * per:(rank + 1) * per]
    if split == "cols":
        per = shape[1] // world
        return part[:, rank * per:(rank + 1) * per]
    return part[:]


def read_shard(model_dir: Path, spec: LlamaSpec, rank: int, world: int,
               device: torch.device) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """(this rank's tensors under the usual names, with its LM head shard; the full LM head [V, H] on rank 0
    only, for the heads' projections, else None)."""
    from safetensors import safe_open

    from engine.models.llama import _safetensors_files
    from engine.models.validate import normalise_llama_names

    out: Dict[str, torch.Tensor] = {}
    lm_head = None
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = next(iter(normalise_llama_names({key: None})))
                if name == "lm_head.weight":
                    lm_head = f.get_tensor(key).to(device)
                    continue
                out[name] = _read_slice(f.get_slice(key), split_of(name), rank, world).to(device)
    if lm_head is None or spec.tie_word_embeddings is True:
        lm_head = out["model.embed_tokens.weight"]  # tied
    out["lm_head.weight"] = vocab_shard(lm_head, rank, world)
    return out, (lm_head if rank == 0 else None)


def local_spec(spec: LlamaSpec, world: int) -> LlamaSpec:
    """The spec one shard runs: heads, kv heads and intermediate size divided by world; its own LM head."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // world,
                               num_kv_heads=spec.num_kv_heads // world,
                               intermediate_size=spec.intermediate_size // world, tie_word_embeddings=False)


class ShardRunner(LlamaRunner):
    """One rank's LlamaRunner over its shard: the o / down partial sums are all-reduced and the LM head's
    vocabulary slices gathered, so every rank ends each layer with the same full hidden state."""

    def __init__(self, spec: LlamaSpec, tensors: Dict[str, torch.Tensor], world: int, **kwargs):
        self.world = world
        self.allreduce_s = 0.0  # host time spent in all-reduces (bench figure; on CUDA it is launch time)
        self.allreduce_calls = 0
        super().__init__(local_spec(spec, world), tensors, **kwargs)
        self.full_spec = spec
        self.use_graphs = False  # collectives are not captured (yet): the shard runs eagerly
        self.decode_kernels = None  # the decode path fuses the residual add that `_residual_out` all-reduces

    def _residual_out(self, x, inputs, weight, bias):
        partial = inputs @ weight.t()  # [n, H]: this rank's share of the row-split product
        started = time.perf_counter()
        dist.all_reduce(partial)
        self.allreduce_s += time.perf_counter() - started
        self.allreduce_calls += 1
        out = x + partial
        return out if bias is None else out + bias

    def project(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x.to(self.dtype), self.lm_head).float()  # [n, Vs]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]  # [n, V]


def load_shard(model_dir: str, rank: int, world: int, device: torch.device, dtype: torch.dtype,
               max_length: Optional[int]) -> Tuple[ShardRunner, Optional[torch.Tensor]]:
    """(this rank's ShardRunner, the full LM head in the runner's dtype on rank 0, else None)."""
    from engine.models.llama import DEFAULT_MAX_LENGTH

    spec = target_spec(Path(model_dir))
    max_length = int(max_length or min(spec.max_position_embeddings, DEFAULT_MAX_LENGTH))
    tensors, lm_head = read_shard(Path(model_dir), spec, rank, world, device)
    shard = ShardRunner(spec, tensors, world, device=device, dtype=dtype, max_length=max_length,
                        path=model_dir)
    return shard, (None if lm_head is None else lm_head.to(dtype))


# ------------------------------------------------------------------------------------------------------------
# The command channel (rank 0 -> the others)


class Channel:
    """Broadcasts of one command: a header [op, a, b, c] int64, then its payload tensors, all on the
    idle-tolerant group (the forward's own collectives run on the default group, with the short timeout)."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device

    def header(self, op: int = 0, a: int = 0, b: int = 0, c: int = 0) -> Tuple[int, int, int, int]:
        t = torch.tensor([op, a, b, c], dtype=torch.long, device=self.device)
        dist.broadcast(t, 0, group=self.group)
        return tuple(t.tolist())  # type: ignore[return-value]

    def tensor(self, t: Optional[torch.Tensor], shape, dtype: torch.dtype) -> torch.Tensor:
        """Rank 0 passes t; the others pass None and get the broadcast values."""
        buf = (t.to(self.device, dtype).contiguous() if t is not None
               else torch.empty(shape, dtype=dtype, device=self.device))
        dist.broadcast(buf, 0, group=self.group)
        return buf


def _serve(shard: ShardRunner, channel: Channel) -> None:
    """A worker's loop: run every command rank 0 broadcasts, until STOP. A command that fails the same way
    on every rank (a bad tree) fails on rank 0 too, which reports it; the worker carries on."""
    while True:
        op, a, b, _ = channel.header()
        if op == STOP:
            return
        try:
            if op == FORWARD:
                tokens = channel.tensor(None, (a,), torch.long)  # [n]
                parents = channel.tensor(None, (a,), torch.long) if b else None  # [n]
                shard.forward(tokens, parents)
            elif op == ROLLBACK:
                shard.rollback(a)
            elif op == COMPACT:
                shard.compact(a, channel.tensor(None, (b,), torch.long))
            elif op == RESET:
                shard.reset()
        except Exception as exc:  # noqa: BLE001 - reported by rank 0 as well
            print(f"tp rank {dist.get_rank()}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------
# Rank 0's runner


class TPRunner(CausalRunner):
    """What the decoder and the drafters see on rank 0: LlamaRunner's interface over the sharded target."""

    supports_tree = True

    def __init__(self, shard: ShardRunner, lm_head: torch.Tensor, group: "TPGroup"):
        self.shard = shard
        self.group = group
        self.spec = shard.full_spec
        self.vocab_size, self.hidden_size = shard.vocab_size, shard.hidden_size
        self.max_length, self.device, self.dtype = shard.max_length, shard.device, shard.dtype
        self.embed_weight, self.norm_weight = shard.embed_weight, shard.norm_weight  # [V, H], [H]
        self.lm_head = lm_head  # [V, H]: the heads' projections (EAGLE, Medusa) run on rank 0 alone
        self.tp = shard.world
        self.forwards = 0  # target steps, for the all-reduce time per step (bench runtimes)

    @property
    def input_fill(self):
        return self.shard.input_fill

    @input_fill.setter
    def input_fill(self, value) -> None:
        self.shard.input_fill = value

    @property
    def use_graphs(self) -> bool:
        return False

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        pass  # the shard runs eagerly (collectives are not captured)

    @property
    def length(self) -> int:
        return self.shard.length

    @property
    def allreduce_s(self) -> float:
        return self.shard.allreduce_s

    def reset(self) -> None:
        with self.group.command():
            self.group.channel.header(RESET)
            self.shard.reset()

    def rollback(self, length: int) -> None:
        self.shard.rollback(length)  # checked here first: a bad length never reaches the workers
        with self.group.command():
            self.group.channel.header(ROLLBACK, int(length))

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self.shard.compact(start, keep)
        with self.group.command():
            self.group.channel.header(COMPACT, int(start), keep.numel())
            self.group.channel.tensor(keep, keep.shape, torch.long)

    def forward(self, tokens: torch.Tensor, parents: Optional[torch.Tensor] = None) -> ForwardOutput:
        tokens = tokens.reshape(-1)
        n = tokens.numel()
        if self.length + n > self.max_length:
            raise SpecplayError(f"context full: {self.length} cached + {n} new tokens exceed max_length "
                                f"{self.max_length}")
        channel = self.group.channel
        self.forwards += 1
        with self.group.command():
            channel.header(FORWARD, n, int(parents is not None))
            tokens = channel.tensor(tokens, (n,), torch.long)
            if parents is not None:
                parents = channel.tensor(parents.reshape(-1), (n,), torch.long)
            return self.shard.forward(tokens, parents)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.final_norm(hidden)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The full LM head on rank 0 (the heads' logits: no collective)."""
        return F.linear(x.to(self.dtype), self.lm_head).float()  # [n, V]

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project(self.final_norm(hidden))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.shard.embed(tokens)


# ------------------------------------------------------------------------------------------------------------
# The launcher


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _init(rank: int, world: int, store_dir: str, device: torch.device):
    """Join the process group; returns the command channel (its own group, tolerant of idle waits)."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(_backend(device), init_method=Path(store_dir, "store").as_uri(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=INIT_TIMEOUT_S))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return Channel(group, _rank_device(device, rank))


def _watch_parent() -> None:
    """Exit when rank 0's process is gone (killed without a chance to say STOP)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(rank: int, world: int, store_dir: str, device: str, dtype: str, model_dir: str,
                 max_length: Optional[int], threads: int, ready) -> None:
    """A worker rank: join, load its shard, say ready (or why not) on the queue, serve until STOP."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is rank 0's to handle; it stops the workers
    _watch_parent()
    torch.set_num_threads(threads)
    dev = torch.device(device)
    ready.put((rank, "started"))
    try:
        channel = _init(rank, world, store_dir, dev)
        shard, _ = load_shard(model_dir, rank, world, _rank_device(dev, rank), DTYPES[dtype], max_length)
    except BaseException as exc:  # noqa: B036 - anything goes back to rank 0 as one line
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((rank, None))
    try:
        with torch.inference_mode():
            _serve(shard, channel)
    except RuntimeError as exc:  # rank 0 went away mid-command (it is being stopped): leave quietly
        print(f"tp rank {rank}: stopped ({str(exc).splitlines()[0][:120]})", file=sys.stderr, flush=True)
        os._exit(1)
    dist.destroy_process_group()


class TPGroup:
    """The worker processes and the process group, from start to a clean stop (or a kill when a command was
    cut short and the ranks no longer agree on what comes next)."""

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device
        self.store_dir = tempfile.mkdtemp(prefix="specplay-tp-")
        self.procs: list = []
        self.channel: Optional[Channel] = None
        self.in_sync = True  # False once a command was interrupted: STOP would then be misread
        self.closed = False

    @contextlib.contextmanager
    def command(self):
        """Mark a command in flight: an exception inside leaves the ranks out of step."""
        self.in_sync = False
        yield
        self.in_sync = True

    def start(self, model_dir: str, dtype: torch.dtype, max_length: Optional[int]) -> TPRunner:
        if self.device.type == "cuda":  # NVLink multicast stays off (shared hosts); the workers inherit it
            for name, value in NO_MULTICAST.items():
                os.environ.setdefault(name, value)
        ctx = torch.multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        name = next(k for k, v in DTYPES.items() if v == dtype)
        for rank in range(1, self.world):
            args = (rank, self.world, self.store_dir, self.device.type, name, model_dir, max_length,
                    torch.get_num_threads(), ready)
            proc = ctx.Process(target=_worker_main, args=args, daemon=True)
            proc.start()
            self.procs.append(proc)
        self._wait(ready, "started")  # a rank dying on the way up is seen here, not as a rendezvous timeout
        self.channel = _init(0, self.world, self.store_dir, self.device)
        shard, lm_head = load_shard(model_dir, 0, self.world, _rank_device(self.device, 0), dtype, max_length)
        self._wait(ready, None)
        return TPRunner(shard, lm_head, self)

    def _wait(self, ready, expected: Optional[str]) -> None:
        """Wait until every worker has put (rank, expected) on the queue; SpecplayError when one reports a
        problem instead, dies, or the time runs out."""
        deadline = time.monotonic() + INIT_TIMEOUT_S
        waiting = set(range(1, self.world))
        while waiting:
            dead = [r for r, proc in enumerate(self.procs, 1) if r in waiting and not proc.is_alive()]
            if dead:
                raise SpecplayError(f"--tp: rank {dead[0]} exited while starting (code "
                                    f"{self.procs[dead[0] - 1].exitcode})")
            if time.monotonic() > deadline:
                raise SpecplayError(f"--tp: ranks {sorted(waiting)} did not start within {INIT_TIMEOUT_S} s")
            try:
                rank, message = ready.get(timeout=0.2)
            except queue.Empty:
                continue
            if message != expected:
                raise SpecplayError(f"--tp: rank {rank} could not load its shard ({message})")
            waiting.discard(rank)

    def close(self) -> None:
        """Stop the workers: STOP when the ranks are in step, else (or if they do not leave) terminate."""
        if self.closed:
            return
        self.closed = True
        if self.in_sync and self.channel is not None and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(Exception):
                self.channel.header(STOP)
            for proc in self.procs:
                proc.join(JOIN_TIMEOUT_S)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(JOIN_TIMEOUT_S)
        if self.in_sync and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        shutil.rmtree(self.store_dir, ignore_errors=True)


_ACTIVE: Optional[TPGroup] = None


def start_target(model_dir: str, tp: int, device: torch.device, dtype: torch.dtype,
                 max_length: Optional[int] = None) -> TPRunner:
    """Check, start tp ranks and return rank 0's TPRunner. One group per process: a previous one is closed;
    the workers stop at exit (or with `shutdown()`)."""
    global _ACTIVE
    check_tp(tp, target_spec(Path(model_dir)), device)
    shutdown()
    group = TPGroup(tp, device)
    _ACTIVE = group
    try:
        return group.start(str(model_dir), dtype, max_length)
    except BaseException:
        group.in_sync = False
        shutdown()
        raise


def shutdown() -> None:
    """Stop the active group's workers (no-op without one)."""
    global _ACTIVE
    if _ACTIVE is not None:
        group, _ACTIVE = _ACTIVE, None
        group.close()


atexit.register(shutdown)


def load_pair(target, draft, tp: int, device="auto", need_draft: bool = True, dtype=None,
              max_length: Optional[int] = None):
    """engine.models.loading.load_pair with the target split over tp ranks (tp 1: load_pair itself)."""
    from engine.models import loading as models

    if not isinstance(tp, int) or tp < 1:
        raise SpecplayError(f"--tp {tp}: must be at least 1")
    if tp == 1:
        return models.load_pair(target, draft, device, need_draft, dtype, max_length)
    if target is None:
        target, shipped_draft = models.shipped_pair()
        draft = shipped_draft if draft is None else draft
    if need_draft and draft is None:
        raise SpecplayError(f"this method needs a draft model; name one with --draft DIR (target: {target})")
    dev = models.resolve_device(device)
    dt = models.resolve_dtype(dtype, dev)
    models.check_model_config(target)
    model_dir = models.resolve_model_dir(target)
    check_tp(tp, target_spec(model_dir), dev)  # before any model is read or rank started
    tokenizer = models.load_tokenizer(target)
    runner = start_target(str(model_dir), tp, dev, dt, max_length)
    models.check_tokenizer_fits(tokenizer, runner.vocab_size, str(target))
    if not need_draft:
        return models.ModelPair(runner, None, tokenizer, str(target), None, runner.vocab_size)
    pair = models.load_pair(draft, None, dev, need_draft=False, dtype=dtype, max_length=max_length)
    models.check_same_vocab(tokenizer, pair.tokenizer, str(target), str(draft),
                            min(runner.vocab_size, pair.vocab_size))
    draft_runner = pair.target
    if draft_runner.vocab_size < runner.vocab_size:
        unk = getattr(tokenizer, "unk_token_id", None)
        draft_runner.input_fill = unk if isinstance(unk, int) and 0 <= unk < draft_runner.vocab_size else 0
    return models.ModelPair(runner, draft_runner, tokenizer, str(target), str(draft), runner.vocab_size)
