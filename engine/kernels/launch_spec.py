"""The host side of the kernels' ABI: argument specs, shared constants and workspace sizes (no CuPy needed).

`SPECS` describes each kernel's parameters as `kernels/specplay_kernels.cu` declares them, in order. A launch
in `engine.kernels.cuda` names every argument; `KernelSpec.values` checks the names and returns the values in
declaration order, ready to pack into the argument block. tests/test_kernels_launch_spec.py parses the .cu
source with `parse_kernels` / `parse_struct_sizes` and checks it against everything here, so that the two
cannot drift apart.
"""
from __future__ import annotations

import operator
import pathlib
import re
from typing import Mapping, NamedTuple

# the .cu sources live in the repository's kernels/ (not a Python package: the name `kernels` is the
# distribution transformers imports)
CU_DIR = pathlib.Path(__file__).resolve().parents[2] / "kernels"
SOURCE = CU_DIR / "specplay_kernels.cu"
COMMON = SOURCE.with_name("cuda_common.cuh")  # the dtype helpers every .cu of kernels/ shares


def module_source() -> str:
    """What NVRTC compiles: the shared dtype helpers, then specplay_kernels.cu."""
    return COMMON.read_text() + "\n" + SOURCE.read_text()

# The .cu's compile-time constants (SP_BLOCK is passed to NVRTC; the others are checked by the tests).
BLOCK = 1024  # threads per block: SP_BLOCK
# loads a thread issues before it ranks them in sp_readout's and sp_topk's scans (SP_LOADS_AHEAD,
# kernels/cuda_common.cuh)
LOADS_AHEAD = 8
ITEMS = 4  # values per thread in one tile: SP_ITEMS
TILE = BLOCK * ITEMS  # tokens per tile, one chunk of a row in the wide kernel: SP_TILE
MAX_V = 262144  # SP_MAX_V
MAX_N = 64  # drafted nodes per verification: SP_MAX_N
READ_MAX_W = 8  # top alternatives per row the readout can give: SP_READ_MAX_W
NULL = 0  # a null pointer argument (an output or input the launch does not use)

# The warp settings (the .cu's struct Cfg) as sp_sample and sp_verify take them, in this order
WARP_ARGS = ("inv_t", "greedy", "top_k", "use_topp", "tp_fixed")

# sizeof of the .cu structs that host-allocated workspaces hold
STRUCT_BYTES = {"RowStats": 32, "Part1": 24, "Walk": 16}

# struct format of each C scalar type; every pointer is a "Q" (uint64)
_SCALAR_FORMATS = {"int": "i", "float": "f", "u64": "Q"}


class Arg(NamedTuple):
    name: str
    ctype: str  # normalised C type, as `parse_params` writes it: "const T*", "int", "u64", ...

    @property
    def format(self) -> str:
        """`struct` format character: Q for a pointer or uint64, i for int32, f for float32."""
        if self.ctype.endswith("*"):
            return "Q"
        if self.ctype not in _SCALAR_FORMATS:
            raise ValueError(f"argument {self.name}: no struct format for C type {self.ctype!r}")
        return _SCALAR_FORMATS[self.ctype]


def parse_params(signature: str) -> tuple[Arg, ...]:
    """A C parameter list as Args: "const float* __restrict__ u, int R" -> (u, "const float*"), (R, "int")."""
    args = []
    for part in signature.split(","):
        words = re.sub(r"\s*\*\s*", "* ", part.replace("__restrict__", " ")).split()
        if len(words) < 2:
            raise ValueError(f"cannot parse the parameter {part.strip()!r}")
        args.append(Arg(words[-1], " ".join(words[:-1])))
    return tuple(args)


class KernelSpec:
    """One kernel's parameters in declaration order, and how they are laid out in its argument block."""

    def __init__(self, name: str, signature: str, templated: bool = False):
        self.name = name
        self.templated = templated  # `template <typename T>`: one instance per logits dtype, `name<T>`
        self.args = parse_params(signature)
        self.names = tuple(a.name for a in self.args)
        self.layout = "".join(a.format for a in self.args)
        self._name_set = frozenset(self.names)
        if len(self._name_set) != len(self.names):
            raise ValueError(f"{name}: repeated argument names")
        name_0 = self.names[0]
        # itemgetter of one name returns the value itself, not a 1-tuple
        self._take = operator.itemgetter(*self.names) if len(self.names) > 1 else (lambda d: (d[name_0],))

    def __repr__(self) -> str:
        return f"KernelSpec({self.name!r}, {', '.join(f'{a.ctype} {a.name}' for a in self.args)!r})"

    def values(self, args: Mapping) -> tuple:
        """The values of `args` (every parameter by name, nothing else) in declaration order."""
        try:
            if len(args) == len(self.names):  # then no name is unknown if none is missing
                return self._take(args)
        except KeyError:
            pass
        missing = [n for n in self.names if n not in args]
        unknown = sorted(set(args) - self._name_set)
        raise TypeError(f"{self.name}: missing arguments {missing}, unknown arguments {unknown}")

    def packing(self) -> tuple[str, tuple[int, ...], int]:
        """(struct format, byte offset of each argument, total bytes) of the argument block.

        Each argument is aligned to its own size (4 or 8 bytes), as CUDA lays out kernel parameters; the
        format is little-endian with explicit padding.
        """
        fmt, offset, offsets = "<", 0, []
        for ch in self.layout:
            size = 8 if ch == "Q" else 4
            pad = (-offset) % size
            fmt += "x" * pad + ch
            offset += pad
            offsets.append(offset)
            offset += size
        return fmt, tuple(offsets), offset


# Written as in the .cu, without __restrict__ (the tests compare them with the source).
SPECS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    KernelSpec("sp_sample",
               "const T* logits, int R, int V, const float* uniforms, float inv_t, int greedy, int top_k, "
               "int use_topp, u64 tp_fixed, int mode, long long* tok_out, float* prob_out, float* probs_out, "
               "int* nan_flag", templated=True),
    KernelSpec("sp_sample_probs",
               "const float* probs, int R, int V, const float* uniforms, long long* tok_out"),
    KernelSpec("sp_verify",
               "const T* logits, int B, int N, int V, const long long* draft, const long long* parents, "
               "const float* q, const float* uniforms, float inv_t, int greedy, int top_k, int use_topp, "
               "u64 tp_fixed, int greedy_verify, RowStats* stats, u32* counters, float* scratch, "
               "long long* out_i, float* out_f, unsigned char* tested, int* nan_flag", templated=True),
    KernelSpec("sp_wide",
               "const T* logits, int B, int N, int V, const long long* draft, const float* q, "
               "const float* uniforms, float inv_t, int greedy, int kind, char* ws, u32* sync, "
               "long long* out_i, float* out_f, unsigned char* tested, long long* tok_out, float* prob_out, "
               "int* nan_flag",
               templated=True),
    KernelSpec("sp_readout",
               "const T* logits, int R, int V, float inv_t, int W, const long long* accepted, "
               "const long long* next_token, const long long* path, const long long* draft, "
               "const float* p_draft, const float* q_draft, const float* accept_prob, "
               "const unsigned char* tested, float* out", templated=True),
    KernelSpec("sp_greedy_readout",
               "const T* logits, int R, int V, int W, const long long* draft, const long long* parents, "
               "const long long* limit, RowStats* stats, u32* counter, long long* out_i, float* out_f, "
               "unsigned char* tested, float* out, int* nan_flag", templated=True),
)}


# ------------------------------------------------------------------------------------------ workspace sizes
def row_stats_bytes(rows: int) -> int:
    """sp_verify's `stats`: one RowStats per row."""
    return rows * STRUCT_BYTES["RowStats"]


def wide_chunks(vocab: int) -> int:
    """Chunks (tiles) a row of `vocab` tokens is cut into by sp_wide."""
    return (vocab + TILE - 1) // TILE


def wide_workspace_bytes(batch: int, rows_per_seq: int, chunks: int) -> int:
    """sp_wide's `ws`, as the kernel carves it: Part1 [B, N+1, C] | RowStats [B, N+1] | Walk [B rounded up to
    even] | double P2 [B, C] | double P3 [B, C] | int L3 [B, C], plus 64 bytes to spare."""
    rows = batch * rows_per_seq
    return (rows * chunks * STRUCT_BYTES["Part1"] + rows * STRUCT_BYTES["RowStats"]
            + (batch + 1) * STRUCT_BYTES["Walk"] + batch * chunks * (8 + 8 + 4) + 64)


def wide_sync_words(batch: int) -> int:
    """sp_wide's `sync` (int32, zeroed): two barrier counters, then one completion counter per sequence."""
    return batch + 2


# ------------------------------------------------------------------------------------------ parsing the .cu
_KERNEL_RE = re.compile(r'(template\s*<\s*typename\s+T\s*(?:,\s*int\s+\w+\s*)*>\s*)?'
                        r'(?:extern\s+"C"\s+)?__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')
_STRUCT_RE = re.compile(r"\bstruct\s+(\w+)\s*\{([^{}]*)\}\s*;")
_FIELD_RE = re.compile(r"([A-Za-z_][\w ]*?)\s+(\w+(?:\s*,\s*\w+)*)")  # "type name" or "type a, b"
_FIELD_BYTES = {"float": 4, "int": 4, "u32": 4, "double": 8, "u64": 8, "unsigned short": 2}


def _strip_comments(source: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", "", source), flags=re.DOTALL)


def parse_kernels(source: str) -> dict[str, KernelSpec]:
    """Every `__global__` function of a .cu source as a KernelSpec (templated: `template <typename T...>`)."""
    return {m.group(2): KernelSpec(m.group(2), m.group(3), templated=bool(m.group(1)))
            for m in _KERNEL_RE.finditer(_strip_comments(source))}


def parse_struct_sizes(source: str) -> dict[str, int]:
    """sizeof of every struct of a .cu source whose fields are all scalars (natural alignment)."""
    sizes = {}
    for name, body in _STRUCT_RE.findall(_strip_comments(source)):
        fields = [_FIELD_RE.fullmatch(decl.strip()) for decl in body.split(";") if decl.strip()]
        if not all(f and f.group(1) in _FIELD_BYTES for f in fields):
            continue  # an array, a nested struct, ...: never allocated on the host
        offset, align = 0, 1
        for f in fields:
            size = _FIELD_BYTES[f.group(1)]
            for _ in f.group(2).split(","):
                offset += (-offset) % size + size
            align = max(align, size)
        sizes[name] = offset + (-offset) % align
    return sizes
