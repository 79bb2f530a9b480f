"""Write draft heads in the public layouts that engine.methods.public_heads reads (and vLLM / SGLang load by
the layouts' definitions): `main.py export-heads --format speculators|specforge|eagle|medusa OUT`.

- medusa: the target's own Medusa heads (MedusaHeads: x + SiLU(W x + b), one or two blocks a head, on the
  target's final-normed feature, through the target's LM head) in FasterDecoding's Medusa-1 layout: keys
  {h}.{l}.linear.weight|bias and {h}.{L}.weight, each head with its own LM head (a copy of the target's),
  config.json with medusa_num_heads, medusa_num_layers, hidden_size, vocab_size. The heads' measured path
  accuracies travel as `specplay_path_accuracy` (other engines ignore the field), so that they draft the same
  trees here as before the export.
- speculators / specforge: an EAGLE-3 head of the published architecture (a --heads folder in one of the
  public EAGLE-3 layouts, or the target's own eagle3/ folder, as the shipped family has it) rewritten in
  the other layout: weights under layers.0.* (speculators) or midlayer.* (SpecForge), the same tensors and
  options. The project's own EAGLE-3 head (proj + fc over [feature ; embedding]) is not that architecture:
  refused.
- eagle: refused; the project's EAGLE head is not the SafeAILab one (see EAGLE_REFUSAL).
Every refusal is one line (SpecplayError) and nothing is written then."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.errors import SpecplayError

FORMATS = ("speculators", "specforge", "eagle", "medusa")
EAGLE_REFUSAL = (
    "--format eagle: the project's EAGLE head cannot be written exactly in the SafeAILab layout: its layer "
    "norms its input (input_layernorm; the published layer 0 has none), it reads the target's feature before "
    "the final norm (the published head reads it after) and its output passes the target's final norm before "
    "the LM head (the published output goes to the LM head as it is); nothing written")


def export(fmt: str, out, target_dir: Path, heads=None, dtype=None) -> str:
    """Write the heads in this format into out (a new or empty folder); returns a one-line summary."""
    if fmt not in FORMATS:
        raise SpecplayError(f"--format {fmt!r}: choose from {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecplayError(f"{out}: not an empty folder (nothing is overwritten)")
    if fmt == "eagle":
        raise SpecplayError(EAGLE_REFUSAL)
    if fmt == "medusa":
        if heads is not None:
            raise SpecplayError("--format medusa writes the target's own Medusa heads; --heads is for an "
                                "EAGLE-3 head of the published architecture")
        return _medusa(out, Path(target_dir), dtype or torch.float32)
    return _eagle3(fmt, out, Path(target_dir), heads)


# ------------------------------------------------------------------------------------------------ Medusa


def _medusa(out: Path, target_dir: Path, dtype) -> str:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.methods.medusa.drafter import HEADS_FILE, MedusaHeads

    if not (target_dir / HEADS_FILE).is_file():
        raise SpecplayError(f"{target_dir}: no Medusa heads ({HEADS_FILE}) to export")
    heads = MedusaHeads.load(target_dir, "cpu", torch.float32)
    lm_head = _target_lm_head(target_dir, safe_open)
    if lm_head.shape[1] != heads.weights[0].shape[0]:
        raise SpecplayError(f"{target_dir}: the LM head {tuple(lm_head.shape)} does not fit the heads' "
                            f"hidden size {heads.weights[0].shape[0]}")
    blocks = [(heads.weights, heads.biases)] + ([heads.second] if heads.second is not None else [])
    tensors = {}
    for h in range(heads.count):
        for b, (weights, biases) in enumerate(blocks):
            tensors[f"{h}.{b}.linear.weight"] = weights[h]
            tensors[f"{h}.{b}.linear.bias"] = biases[h]
        tensors[f"{h}.{len(blocks)}.weight"] = lm_head  # each head's own LM head: the target's, copied
    tensors = {k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}
    config = {"medusa_num_heads": heads.count, "medusa_num_layers": len(blocks),
              "hidden_size": int(lm_head.shape[1]), "vocab_size": int(lm_head.shape[0]),
              "base_model_name_or_path": str(target_dir), "architectures": ["MedusaModel"]}
    if heads.path_accuracy is not None:
        config["specplay_path_accuracy"] = [[list(path), chance] for path, chance in heads.path_accuracy]
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return (f"wrote {heads.count} Medusa heads ({len(blocks)} block(s) a head, {str(dtype)[6:]}) in the "
            f"Medusa-1 (FasterDecoding) layout to {out}")


def _target_lm_head(target_dir: Path, safe_open) -> torch.Tensor:
    """The target's LM head [V, H] in float32 (its embedding where the two are tied)."""
    where = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            where.update({name: f for name in st.keys()})
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in where:
            with safe_open(str(where[name]), framework="pt", device="cpu") as st:
                return st.get_tensor(name).float()
    raise SpecplayError(f"{target_dir}: no lm_head.weight or model.embed_tokens.weight in its safetensors")


# ------------------------------------------------------------------------------------------------ EAGLE-3


def _eagle3(fmt: str, out: Path, target_dir: Path, heads) -> str:
    from safetensors.torch import load_file, save_file

    from engine.methods import public_heads as ph
    from engine.methods.eagle3.drafter import HEAD_FILE, own_published_head
    from engine.methods.eagle3.public import layer_source

    if heads is None:
        heads = own_published_head(target_dir)
        if heads is None:
            own = " (its eagle3_head.safetensors is the project's own architecture)" if (
                target_dir / HEAD_FILE).is_file() else ""
            raise SpecplayError(f"--format {fmt}: {target_dir} has no EAGLE-3 head of the published "
                                f"architecture{own}; name one with --heads DIR; nothing written")
    info = ph.detect(heads)
    if info.method != "eagle3":
        raise SpecplayError(f"--format {fmt}: {info.folder} holds {info.layout} heads, not EAGLE-3")
    layer, prefix = layer_source(info)
    tensors = (load_file(str(info.weights)) if info.weights.suffix == ".safetensors"
               else ph._torch_load(info.weights))
    new_prefix = "layers.0." if fmt == "speculators" else "midlayer."
    tensors = {(new_prefix + k[len(prefix):] if k.startswith(prefix) else k): v.contiguous()
               for k, v in tensors.items()}
    options = {k: info.config[k] for k in ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                                           "norm_before_fc", "fc_norm", "norm_output")
               if k in info.config}
    options.setdefault("draft_vocab_size", tensors["lm_head.weight"].shape[0])
    taps = list(info.taps) if info.taps is not None else None
    layer = {k: v for k, v in layer.items() if k not in options and k not in (
        "architectures", "eagle_config", "eagle_aux_hidden_state_layer_ids", "base_model_name_or_path")
        and not k.startswith("speculators_")}
    if fmt == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **layer}, **options,
                  "speculators_config": _speculators_part(info)}
        if taps is not None:
            config["eagle_aux_hidden_state_layer_ids"] = taps
    else:
        config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, **options}
        config["model_type"] = "llama"
        if taps is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": taps}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return f"wrote the EAGLE-3 head of {info.folder} ({info.layout}) in the {fmt} layout to {out}"


def _speculators_part(info) -> dict:
    part = info.config.get("speculators_config")
    if isinstance(part, dict):
        return part
    return {"algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
            "verifier": {"name_or_path": info.trained_for or "unknown",
                         "architectures": ["LlamaForCausalLM"]}}
