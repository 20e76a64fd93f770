"""Trained drafts out to the serving engines' DSpark layouts, and published drafts in.

Layouts (one module each, :data:`LAYOUTS`): ``deepspec`` (DeepSpec's released layout, ``Qwen3DSparkModel``:
vLLM, SGLang, TensorRT-LLM, llama.cpp) and ``speculators`` (vLLM ``speculators``' DSpark layout). An exported
directory holds ``config.json`` + ``model.safetensors`` (bf16 unless asked) + ``README.md`` with the serve
command. :func:`load_any_draft` reads dspark's own checkpoints and both layouts.

Shape legend: V vocab, Ht target hidden.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from dspark_core.errors import UserError
from dspark_core.export import deepspec, speculators
from dspark_core.export.common import (DTYPES, VOCAB_KEYS, ForeignDraft, check_exportable, check_head_rows,
                                       check_layer_config, from_layout_names, read_config, to_layout_names, write_dir)

LAYOUTS: dict[str, ModuleType] = {deepspec.NAME: deepspec, speculators.NAME: speculators}


def layout_module(layout: str) -> ModuleType:
    if layout not in LAYOUTS:
        raise UserError(f"export: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    return LAYOUTS[layout]


def serve_command(target: str, out_dir: str | Path, block_size: int) -> str:
    spec = f'{{"method": "dspark", "model": "{out_dir}", "num_speculative_tokens": {block_size}}}'
    return f"vllm serve {target} --speculative-config '{spec}'"


def readme(layout: str, variant: str, target: str, out_dir: str | Path, block_size: int) -> str:
    return (f"# DSpark draft `{variant}` ({layout} layout)\n\n"
            f"Exported by `dspark export` for the target `{target}`: config.json + model.safetensors.\n"
            "Serve it with vLLM (its DSpark decode runs on CUDA):\n\n"
            f"```\n{serve_command(target, out_dir, block_size)}\n```\n")


def export_draft(draft: Any, out_dir: str | Path, layout: str, dtype: str = "bfloat16", target: str = "",
                 variant: str = "draft") -> Path:
    """Write ``draft`` (a ``DSparkDraft``) to ``out_dir`` in ``layout``; refuse what the engines cannot run."""
    mod = layout_module(layout)
    if dtype not in DTYPES:
        raise UserError(f"export: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_exportable(draft, layout)
    target = target or getattr(draft.hf_config, "_name_or_path", "") or "TARGET"
    config = mod.build_config(draft, dtype, target)
    weights = {**to_layout_names(draft, DTYPES[dtype], mod.TARGET_COPIES), **mod.vocab_weights(draft, DTYPES[dtype])}
    return write_dir(Path(out_dir), config, weights, readme(layout, variant, target, out_dir, draft.block_size))


def detect_layout(path: str | Path) -> str | None:
    """``deepspec`` / ``speculators`` for an engine-layout directory, None for a dspark checkpoint."""
    config = read_config(Path(path))
    for name, mod in LAYOUTS.items():
        if mod.detect(config):
            return name
    if config.get("format") == "dspark-draft":
        return None
    raise UserError(f"{Path(path) / 'config.json'}: neither a dspark draft nor a DSpark draft of the "
                    f"{' / '.join(LAYOUTS)} layouts (no speculators_model_type: dspark, no Qwen3DSparkModel)")


def read_foreign(path: str | Path) -> ForeignDraft:
    path = Path(path)
    layout = detect_layout(path)
    if layout is None:
        raise UserError(f"{path}: a dspark checkpoint, not an engine layout")
    return LAYOUTS[layout].read(read_config(path), str(path / "config.json"))


def check_target(foreign: ForeignDraft, target_model: Any, src: str) -> None:
    """Vocabulary, hidden size and aux layer ids of a foreign draft against ``target_model`` (this replaces the
    fingerprint check of dspark's own checkpoints, which foreign drafts do not carry)."""
    from dspark_core.draft.model import check_aux_layer_ids

    tc = target_model.config
    have = {"vocab_size": target_model.get_output_embeddings().weight.shape[0], "hidden_size": tc.hidden_size,
            "num_hidden_layers": tc.num_hidden_layers}
    for key, value in foreign.target.items():
        if value is not None and value != have[key]:
            raise UserError(f"{src}: draft made for another target: its {key} is {value}, the given target has "
                            f"{have[key]}; use the draft's own target")
    try:
        check_aux_layer_ids(foreign.aux_layer_ids, tc.num_hidden_layers)
    except ValueError as e:
        raise UserError(f"{src}: target layer ids {list(foreign.aux_layer_ids)} do not fit the given target "
                        f"({tc.num_hidden_layers} layers): {e}") from None
    mask = foreign.draft["mask_token_id"]
    if not 0 <= mask < have["vocab_size"]:
        raise UserError(f"{src}: mask_token_id {mask} is outside the target's vocabulary ({have['vocab_size']})")


def foreign_warm_start(path: str | Path, draft: Any) -> dict[str, Any]:
    """The weights of an engine-layout draft under dspark's names, for a warm start of ``draft`` (a
    ``DSparkDraft`` being trained): its vocabulary, target width, aux layer ids and block size must be the draft's."""
    path = Path(path)
    src = str(path / "config.json")
    foreign = read_foreign(path)
    have = {"vocab_size": draft.vocab_size, "hidden_size": draft.target_hidden_size,
            "num_hidden_layers": draft.target_summary["num_hidden_layers"]}
    for key, value in foreign.target.items():
        if value is not None and value != have[key]:
            raise UserError(f"warm start: {src}: draft made for another target: its {key} is {value}, this "
                            f"target has {have[key]}")
    if tuple(foreign.aux_layer_ids) != tuple(draft.aux_layer_ids) or foreign.draft["block_size"] != draft.block_size:
        raise UserError(f"warm start: {src}: target layer ids {list(foreign.aux_layer_ids)} / block size "
                        f"{foreign.draft['block_size']} differ from this run's {list(draft.aux_layer_ids)} / "
                        f"{draft.block_size}; set cache.aux_layer_ids and draft.block_size to the draft's")
    if foreign.draft.get("vocab_size") != draft.cfg.vocab_size:
        raise UserError(f"warm start: {src}: draft vocabulary {foreign.draft.get('vocab_size') or 'full'}, this run's "
                        f"draft.vocab_size is {draft.cfg.vocab_size or 'null (full)'}; set draft.vocab_size to the "
                        "draft's")
    check_layer_config(foreign.hf, draft.hf_config, src)
    return draft_weights(path, draft.lm_head_weight, draft.embedding_matrix())


def draft_weights(path: Path, lm_head: Any, embedding: Any = None) -> dict[str, Any]:
    """An engine-layout directory's draft weights under dspark's names, a reduced vocabulary's maps as dspark's
    ``draft_vocab.*``; its copies of the target's LM head (rows) and embedding checked against ``lm_head`` and
    ``embedding`` [V, Ht], the target's."""
    raw = read_weights(path)
    f = str(path / "model.safetensors")
    weights = from_layout_names(raw, f)
    check_head_rows(raw, weights.get(VOCAB_KEYS[0]), lm_head, f, embedding)
    return weights


def read_weights(path: Path) -> dict[str, Any]:
    """``path/model.safetensors`` of an engine-layout draft, checked against ``manifest.json`` where the directory
    has one (dspark's exports do; a published draft may not, and is read as it is)."""
    from dspark_core.checkpoint import MANIFEST, load_tensors, verify_manifest

    fix = f"export it again (dspark export) or restore {path}"
    if (path / MANIFEST).is_file():
        verify_manifest(path, fix)
    if not (path / "model.safetensors").is_file():
        raise UserError(f"{path}: no model.safetensors")
    return load_tensors(path / "model.safetensors", fix)


def load_foreign_draft(path: str | Path, target_model: Any) -> Any:
    """A DeepSpec- or speculators-layout draft rebuilt as a ``DSparkDraft`` on ``target_model`` (its embedding
    and LM head, device and dtype; the directory's copies of them are not read)."""
    from dspark_core.draft.config import DraftConfig
    from dspark_core.draft.model import build_draft

    path = Path(path)
    src = str(path / "config.json")
    foreign = read_foreign(path)
    check_target(foreign, target_model, src)
    check_layer_config(foreign.hf, target_model.config, src)
    cfg = DraftConfig.from_dict(foreign.draft, src=src, prefix="draft.")
    lm = target_model.get_output_embeddings().weight
    draft = build_draft(cfg, target_model.config, target_model.get_input_embeddings().weight, lm,
                        aux_layer_ids=foreign.aux_layer_ids)
    f = path / "model.safetensors"
    weights = draft_weights(path, lm, target_model.get_input_embeddings().weight)
    own = draft.own_state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise UserError(f"{f}: weights do not match config.json (missing {missing[:3]}, unexpected {unexpected[:3]})")
    bad = [k for k, v in weights.items() if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise UserError(f"{f}: {bad[0]} has shape {tuple(weights[bad[0]].shape)}, expected {tuple(own[bad[0]].shape)}")
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False)
    return draft.to(device=lm.device, dtype=lm.dtype).eval()


def load_any_draft(path: str | Path, target_model: Any, expected_fingerprint: str | None = None) -> Any:
    """A dspark checkpoint (fingerprint-checked) or an engine-layout draft (checked by shapes and layer ids)."""
    from dspark_core.checkpoint import load_draft

    if detect_layout(path) is None:
        return load_draft(path, target_model, expected_fingerprint=expected_fingerprint)
    return load_foreign_draft(path, target_model)
