"""Measure how often each path of Medusa head candidates is right all the way; save it in medusa_config.json.

    .venv/bin/python scripts/training/calibrate_medusa.py [--model assets/models/target] [--device cpu]

The drafter builds its tree from these path accuracies (engine/methods/medusa/drafter.py). New training runs
save them (the medusa stage); this script adds them to heads trained before that, measured the way the stage
does: on the `full` preset's validation windows (64 x 1024 tokens of this interpreter's standard-library files
that the models never trained on).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "assets" / "models" / "target"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from engine.train import corpus, heads, lm
    from engine.train import tokenizer as tk
    from engine.train.presets import full as full_preset

    model = Path(args.model)
    preset = full_preset()
    device = torch.device(args.device)
    files = corpus.load_corpus(preset.max_files, preset.max_file_bytes, preset.val_fraction)
    val_texts = [f.text for f in files if f.split == "val"]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    val_ids = tk.encode_documents(tok, val_texts)
    windows = lm.TokenData(np.zeros(0, dtype=np.uint16), val_ids, device, preset.seed).val_windows(
        preset.eval_windows, preset.seq_len)
    target = heads.freeze(lm.load_lm(model, device).float())
    medusa = heads.freeze(heads.load_medusa(model).to(device))
    result = heads.eval_medusa(medusa, target, windows, device)
    config_path = model / "medusa_config.json"
    config = json.loads(config_path.read_text())
    measured = heads.medusa_config(medusa, config["hidden_size"], result["path_accuracy"])
    for key in ("rank_accuracy", "rank_accuracy_meaning"):
        config.pop(key, None)
    config.update({key: measured[key] for key in ("path_accuracy", "path_accuracy_meaning")})
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    print(f"{len(val_texts)} validation files, {len(val_ids)} tokens, {windows.shape[0]} windows of "
          f"{windows.shape[1] - 1}")
    print("most often right paths (ranks of heads 1, 2, ...):")
    for path, chance in result["path_accuracy"][:16]:
        print(f"  {list(path)}: {chance:.4f}")
    print(f"wrote {config_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
