"""What both serving layouts share: which drafts export, the weight names, writing and reading a directory.

Shape legend: V vocab, Ht target hidden, H draft hidden, K aux layers, r Markov rank, L draft layers.

The serving engines (vLLM's ``Qwen3DSparkModel``, DeepSpec's Qwen3 DSpark draft, ``speculators``' DSpark model)
run one architecture: the DSpark paper's baseline draft with Qwen3 decoder layers, ``fc`` [H, K*H] over the
concatenated aux hidden states, the MASK slots fed as a real vocabulary row, a vanilla first-order Markov head and
an optional confidence head. A dspark draft exports when it is exactly that (:func:`check_exportable` says why not
otherwise); its weights then map one to one onto the layouts' names (:func:`to_layout_names`). The DeepSpec layout
holds the target's embedding and LM head beside them (its model has both); the speculators layout leaves them out,
as speculators' own writer does for a full-vocabulary draft (its loader and vLLM take them from the verifier).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark_core.errors import UserError

# dspark name prefix -> layout name prefix (everything else keeps its name: fc, hidden_norm, layers.N.*, norm)
RENAMES = (("markov.w1.", "markov_head.markov_w1."), ("markov.w2.", "markov_head.markov_w2."),
           ("confidence.", "confidence_head."))
FROZEN_NAMES = ("embed_tokens.weight", "lm_head.weight")  # the target's copies in an exported directory
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
REDUCED_VOCAB_LAYOUTS = ("speculators",)  # layouts that write a reduced draft vocabulary's d2t / t2d maps
VOCAB_KEYS = ("draft_vocab.d2t", "draft_vocab.t2d")  # dspark's maps (int64); each layout writes its own form
SKIPPED = "SKIPPED.txt"  # in data/export/<variant>/<layout>/ when the layout cannot run the draft (unsupported: skip)
EXPORT_FILES = frozenset({"config.json", "model.safetensors", "README.md", "manifest.json", SKIPPED})


@dataclass(frozen=True)
class ForeignDraft:
    """A draft directory in an engine layout, read back: dspark's ``draft`` params, the aux layer ids (dspark's
    convention: decoder layer ``i``'s output), and what the draft says of its target."""

    draft: dict[str, Any]
    aux_layer_ids: tuple[int, ...]
    target: dict[str, Any] = field(default_factory=dict)  # vocab_size, hidden_size, num_hidden_layers (when known)
    hf: dict[str, Any] = field(default_factory=dict)  # its layers' Qwen3 config fields (RoPE, norm, layer types)


def check_exportable(draft: Any, layout: str) -> None:
    """Refuse, naming the variant and why, a draft the engines cannot run as written."""
    cfg, name = draft.cfg, f"draft.kind {draft.cfg.kind!r}"
    if cfg.kind != "baseline":
        raise UserError(f"export --layout {layout}: {name} is not exportable: the serving engines run the DSpark "
                        "baseline draft only (no Engram table, Draft Memory or prefix reranker); export a "
                        "baseline-kind draft")
    if draft.mask_embedding is not None:
        raise UserError(f"export --layout {layout}: {name} has a learned mask vector; the engines feed MASK as a "
                        "vocabulary row. Retrain with draft.mask_token_id set to an unused token id of the target's "
                        f"vocabulary (< {draft.vocab_size})")
    if draft.hidden_size != draft.target_hidden_size:
        raise UserError(f"export --layout {layout}: {name} is {draft.hidden_size} wide, the target "
                        f"{draft.target_hidden_size}; the layouts' fc maps K x the draft width, so the projections "
                        "do not fold. Retrain with draft.hidden_size null (the target's width)")
    if draft.layers[0].self_attn.q_norm is None or draft.layer_family != "qwen3":
        raise UserError(f"export --layout {layout}: {name} has {draft.model_type} layers (no q/k RMSNorm); the "
                        "engines' DSpark layers are Qwen3's. Retrain with draft.layer_style: qwen3")
    if not cfg.has_markov:
        raise UserError(f"export --layout {layout}: {name} has markov_head 'none'; vLLM's DSpark model always runs "
                        "a vanilla Markov head (markov_w1 / markov_w2). Retrain with draft.markov_head: vanilla")
    if cfg.markov_head != "vanilla":
        raise UserError(f"export --layout {layout}: {name} has markov_head {cfg.markov_head!r}; vLLM's DSpark model "
                        "runs the vanilla Markov head only (markov_w1 / markov_w2), so this draft would load and "
                        "propose wrong tokens. Retrain with draft.markov_head: vanilla")
    if getattr(draft, "draft_vocab", None) is not None and layout not in REDUCED_VOCAB_LAYOUTS:
        raise UserError(f"export --layout {layout}: {name} has a reduced draft vocabulary (draft.vocab_size "
                        f"{cfg.vocab_size}); the {layout} layout has no d2t / t2d maps, so its W2 and LM head "
                        f"would claim the full vocabulary. Export it with --layout {REDUCED_VOCAB_LAYOUTS[0]} "
                        f"(the export stage: export.layouts: [{REDUCED_VOCAB_LAYOUTS[0]}] in params.yaml), or "
                        "retrain with draft.vocab_size null")


def to_layout_names(draft: Any, dtype: torch.dtype, with_target_copies: bool = True) -> dict[str, torch.Tensor]:
    """The draft's weights under the layouts' names (+ the target's embedding and LM head when
    ``with_target_copies``), in ``dtype``."""
    out = {}
    for name, w in draft.own_state_dict().items():
        if name in VOCAB_KEYS:
            continue
        for old, new in RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = w
    if with_target_copies:
        out["embed_tokens.weight"] = draft.embedding_matrix()  # [V, Ht]
        out["lm_head.weight"] = draft.lm_head_weight  # [V, Ht]
    return {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in out.items()}


def from_layout_names(weights: dict[str, torch.Tensor], src: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_layout_names` on the draft's own weights (the target's copies dropped); a reduced
    draft vocabulary's ``d2t`` / ``t2d`` (speculators' form) become dspark's ``draft_vocab.d2t`` / ``t2d``."""
    from dspark_core.draft.vocab import from_speculators_maps

    out = {}
    if "d2t" in weights or "t2d" in weights:
        if not ("d2t" in weights and "t2d" in weights):
            raise UserError(f"{src}: holds only one of d2t / t2d; a reduced draft vocabulary needs both")
        d2t, t2d = from_speculators_maps(weights["d2t"], weights["t2d"], src)
        if d2t.shape[0] < t2d.shape[0]:  # identity maps (a full vocabulary written with them) mean no maps
            out.update(zip(VOCAB_KEYS, (d2t, t2d)))
    for name, w in weights.items():
        if name in FROZEN_NAMES or name in ("d2t", "t2d"):
            continue
        for old, new in RENAMES:
            if name.startswith(new):
                name = old + name[len(new):]
        out[name] = w
    return out


def check_head_rows(weights: dict[str, torch.Tensor], d2t: torch.Tensor | None, lm_head: torch.Tensor,
                    src: str, embedding: torch.Tensor | None = None) -> None:
    """The target's copies in a draft directory must be the given target's: ``lm_head.weight`` its LM head
    [V, Ht] (a reduced draft: its rows at the target ids ``d2t`` [N]) and ``embed_tokens.weight`` its embedding
    [V, Ht]. dspark drafts predict with the frozen target rows; a draft made for another target of the same
    shapes (a base model's draft on its instruct model), or one that trained its own head, is refused."""
    checks = [("lm_head.weight", lm_head, "LM head"), ("embed_tokens.weight", embedding, "embedding")]
    for name, mine, what in checks:
        if name not in weights or mine is None:
            continue
        if name == "lm_head.weight" and d2t is not None:
            what += " rows at d2t"
            mine = mine.detach().to("cpu").index_select(0, d2t.cpu())  # [N, Ht]
        have = weights[name]  # [V or N, Ht]
        if tuple(have.shape) != tuple(mine.shape) or not torch.equal(have, mine.detach().to("cpu", have.dtype)):
            raise UserError(f"{src}: {name} {tuple(have.shape)} is not the given target's {what}; dspark drafts "
                            "predict with the target's own rows: import it with the target it was trained on")


DROPPED_HF_KEYS = ("architectures", "auto_map", "_name_or_path", "_model_name_or_path", "transformers_version",
                   "torch_dtype", "dtype", "use_sliding_window", "max_window_layers", "sliding_window", "id2label",
                   "label2id", "problem_type", "chunk_size_feed_forward", "return_dict", "output_attentions",
                   "output_hidden_states", "is_encoder_decoder")


def qwen3_fields() -> frozenset[str]:
    """The keys a Qwen3 config.json may hold (transformers' ``Qwen3Config`` fields, RoPE in both its forms)."""
    from transformers import Qwen3Config

    return frozenset(Qwen3Config().to_dict()) | {"rope_theta", "rope_scaling"}


def draft_hf_fields(draft: Any) -> dict[str, Any]:
    """The target's HF config with the draft's depth and widths, as a Qwen3 config dict.

    Only Qwen3 fields are kept: the target's other keys (``quantization_config`` of a quantised target above
    all: an engine would build quantised layers for the bf16 draft) describe the target, not the draft. A scaled
    RoPE is written in both forms, ``rope_parameters`` (transformers 5) and ``rope_scaling`` (transformers 4 and
    the loaders that read only that), so no loader runs it unscaled."""
    fields = qwen3_fields()
    hf = {k: v for k, v in draft.hf_config.to_dict().items() if k in fields and k not in DROPPED_HF_KEYS}
    rope = rope_of(hf)
    hf.update(model_type="qwen3", num_hidden_layers=draft.cfg.num_draft_layers, head_dim=draft.hf_config.head_dim,
              layer_types=["full_attention"] * draft.cfg.num_draft_layers, tie_word_embeddings=False,
              attention_bias=bool(getattr(draft.hf_config, "attention_bias", False)), use_sliding_window=False)
    if rope.get("rope_theta") is not None:
        hf["rope_theta"] = rope["rope_theta"]
    if rope["rope_type"] != "default":
        hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return hf


def rope_of(hf: dict[str, Any]) -> dict[str, Any]:
    """A config dict's RoPE as one flat dict {rope_type, rope_theta, ...}, from ``rope_parameters`` (transformers 5)
    or ``rope_theta`` + ``rope_scaling`` (transformers 4; its ``type`` read as ``rope_type``)."""
    params = hf.get("rope_parameters")
    rope = dict(params) if isinstance(params, dict) else dict(hf.get("rope_scaling") or {})
    kind = rope.pop("type", None)
    rope["rope_type"] = rope.get("rope_type") or kind or "default"
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = hf.get("rope_theta")
    return rope


def check_layer_config(hf: dict[str, Any], target_config: Any, src: str) -> None:
    """Refuse a foreign draft whose layers dspark would run differently from its engine: dspark runs every draft
    layer as full (bidirectional) attention with the target's RoPE, RMSNorm epsilon and activation."""
    types = set(hf.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        raise UserError(f"{src}: layer_types {sorted(types)}; dspark runs every draft layer as full attention over "
                        "the block and its context, so this draft cannot be imported")
    causal = hf.get("is_causal") or (hf.get("dflash_config") or {}).get("causal")
    if causal:
        raise UserError(f"{src}: a causal draft (is_causal / dflash_config.causal); dspark's DSpark blocks attend "
                        "bidirectionally, so this draft cannot be imported")
    want = target_config.to_dict()
    mine, theirs = rope_of(hf), rope_of(want)
    keys = {"rope_type", "rope_theta"} | (set(mine) & set(theirs))  # a key only one config version writes: not read
    differ = sorted(k for k in keys if mine.get(k) != theirs.get(k))
    if mine.get("rope_theta") is not None and differ:
        raise UserError(f"{src}: RoPE {', '.join(f'{k} {mine.get(k)!r}' for k in differ)} differs from the "
                        f"target's {', '.join(repr(theirs.get(k)) for k in differ)}; dspark runs the draft's layers "
                        "with the target's RoPE: import it with the target it was trained on")
    for key in ("rms_norm_eps", "hidden_act"):
        if hf.get(key) is not None and want.get(key) is not None and hf[key] != want[key]:
            raise UserError(f"{src}: {key} {hf[key]!r} differs from the target's {want[key]!r}; dspark runs the "
                            "draft's layers with the target's")


def head_fields(draft: Any) -> dict[str, Any]:
    """Markov / confidence head fields, named as both layouts name them."""
    cfg = draft.cfg
    return {"markov_rank": cfg.markov_rank if cfg.has_markov else 0, "markov_head_type": "vanilla",
            "enable_confidence_head": bool(cfg.confidence_head),
            "confidence_head_with_markov": bool(cfg.confidence_head and cfg.has_markov and cfg.confidence_with_markov)}


def draft_params(hf: dict[str, Any], *, block_size: int, mask_token_id: Any, markov_rank: int,
                 conf: bool, conf_markov: bool, src: str) -> dict[str, Any]:
    """dspark ``draft`` params of a foreign draft from its Qwen3 config fields."""
    if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool):
        raise UserError(f"{src}: mask_token_id is {mask_token_id!r}; a DSpark draft needs an integer token id")
    return {"num_draft_layers": int(hf["num_hidden_layers"]), "block_size": int(block_size),
            "mask_token_id": mask_token_id, "markov_rank": int(markov_rank) or 1,
            "markov_head": "vanilla" if markov_rank else "none", "confidence_head": bool(conf),
            "confidence_with_markov": bool(conf_markov), "hidden_size": int(hf["hidden_size"]),
            "intermediate_size": int(hf["intermediate_size"]), "num_attention_heads": int(hf["num_attention_heads"]),
            "num_key_value_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            "head_dim": int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
            "layer_style": "qwen3", "kind": "baseline"}


def check_markov_type(value: Any, src: str) -> None:
    if value not in (None, "vanilla"):
        raise UserError(f"{src}: markov_head_type {value!r} is not supported by dspark (vanilla only); this draft "
                        "cannot be imported")


def read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.is_file():
        raise UserError(f"{path}: no config.json (not a draft directory)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{f}: not valid JSON ({e})") from None


def check_replaceable(out: Path) -> None:
    """An export replaces its directory whole: refuse an ``out`` that is anything but a missing or empty directory
    or an earlier export (so a mistyped path never deletes a user's files)."""
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_symlink() or not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory; an export writes a directory there: give a new path")
    other = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES)
    if other:
        raise UserError(f"{out}: holds {', '.join(other[:5])}{' ...' if len(other) > 5 else ''}, so it is not an "
                        "earlier export; an export replaces its directory whole: give a new or empty directory")


def write_dir(out: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], readme: str) -> Path:
    """config.json + model.safetensors + README.md (+ manifest.json: their sizes and SHA-256, checked on import)
    written into a temp dir that then replaces ``out`` whole (a crash leaves the old directory or none, never a mix).
    ``out`` must be new, empty or an earlier export (:func:`check_replaceable`)."""
    from safetensors.torch import save_file

    from dspark_core.checkpoint import write_manifest

    from dspark_core.io import write_json
    from dspark_core.target import atomic_dir

    check_replaceable(out)
    with atomic_dir(out) as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(readme)
        write_json(tmp / "config.json", config)
        write_manifest(tmp, ["config.json", "model.safetensors", "README.md"])
    return out
