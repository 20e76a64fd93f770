"""DeepSpec's released DSpark layout (e.g. ``deepseek-ai/dspark_qwen3_8b_block7``), which vLLM, SGLang,
TensorRT-LLM and llama.cpp load as ``Qwen3DSparkModel``.

``config.json`` is the target's HF config made a Qwen3 one (``model_type: qwen3``, Qwen3 fields only) with the
draft's depth and widths, plus ``block_size``, ``mask_token_id`` (a vocabulary row), ``target_layer_ids`` (decoder
layer ``i``'s output, -1 the embedding output: dspark's ``aux_layer_ids`` as they are), ``num_target_layers``,
``markov_rank`` / ``markov_head_type`` and the confidence flags. The anchor slot predicts the next token, so vLLM
serves ``num_speculative_tokens = block_size``. Weights: ``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``, ``markov_head.markov_w1`` / ``markov_w2``,
``confidence_head.proj``, ``embed_tokens``, ``lm_head``.
"""

from __future__ import annotations

from typing import Any

from dspark_core.errors import UserError
from dspark_core.export.common import ForeignDraft, check_markov_type, draft_hf_fields, draft_params, head_fields

TARGET_COPIES = True  # embed_tokens / lm_head written (see common.py)
NAME = "deepspec"
ARCHITECTURE = "Qwen3DSparkModel"


def build_config(draft: Any, dtype: str, target: str) -> dict[str, Any]:
    """config.json of ``draft`` (``target``: the target's name or path, recorded for the serve command)."""
    tc = draft.target_summary
    return {**draft_hf_fields(draft), "architectures": [ARCHITECTURE], "torch_dtype": dtype,
            "num_target_layers": tc["num_hidden_layers"], "block_size": draft.block_size,
            "mask_token_id": draft.mask_token_id, "target_layer_ids": list(draft.aux_layer_ids),
            "num_anchors": draft.cfg.num_anchors, "use_aux_hidden_state": True, **head_fields(draft),
            "dspark_target": target}


def vocab_weights(draft: Any, dtype: Any) -> dict[str, Any]:
    """No maps: this layout has no reduced draft vocabulary (``check_exportable`` refuses one)."""
    return {}


def detect(config: dict[str, Any]) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) and "speculators_model_type" not in config


def read(config: dict[str, Any], src: str) -> ForeignDraft:
    """dspark params of a DeepSpec-layout config.json (``src`` names it in errors)."""
    missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids", "hidden_size", "num_hidden_layers",
                           "intermediate_size", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise UserError(f"{src}: a {ARCHITECTURE} config needs {missing}")
    check_markov_type(config.get("markov_head_type"), src)
    conf = bool(config.get("enable_confidence_head", False))
    draft = draft_params(config, block_size=config["block_size"], mask_token_id=config["mask_token_id"],
                         markov_rank=int(config.get("markov_rank", 0)), conf=conf,
                         conf_markov=conf and bool(config.get("confidence_head_with_markov", False)), src=src)
    target = {"vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
              "num_hidden_layers": config.get("num_target_layers")}
    return ForeignDraft(draft=draft, aux_layer_ids=tuple(int(i) for i in config["target_layer_ids"]), target=target,
                        hf=config)
