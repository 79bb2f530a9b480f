#!/usr/bin/env bash
# Unpack what scripts/training/train_family_gpu.sh brought back into the shipped layout and refresh the model card:
#   bash scripts/training/unpack_family.sh <folder with target_model.safetensors and family_rest.tar> [assets/models]
# The destination is replaced (its old files are removed first). The card's file table (sizes, sha256) is
# rewritten by engine.train.export's refresh (held-out sample losses re-measured on the CPU), keeping the
# card's measured-speculation section as the export wrote it.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then   # the comment above is the usage
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0
fi
set -euo pipefail
SRC=${1:?usage: unpack_family.sh SRC_DIR [DEST]}
DEST=${2:-assets/models}
PY=${PY:-python3}
[ -f "$SRC/target_model.safetensors" ] && [ -f "$SRC/family_rest.tar" ] || {
  echo "$SRC: needs target_model.safetensors and family_rest.tar (an export that finished)" >&2; exit 2; }
tmp=$(mktemp -d)
tar xf "$SRC/family_rest.tar" -C "$tmp"
[ -f "$tmp/target/config.json" ] && [ -f "$tmp/README.md" ] || {
  echo "$SRC/family_rest.tar holds checkpoints, not an exported family (the run stopped before export)" >&2
  rm -rf "$tmp"; exit 3; }
cp "$SRC/target_model.safetensors" "$tmp/target/model.safetensors"
[ -f "$SRC/train_log.txt" ] && cp "$SRC/train_log.txt" "$tmp/train_log.txt"
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$tmp" "$DEST"
$PY -m engine.train.export "$DEST" >/dev/null
du -sb "$DEST"
