"""vLLM ``speculators``' DSpark layout (``speculators_model_type: dspark``), which vLLM also serves.

``config.json``: ``transformer_layer_config`` (the draft's Qwen3 decoder config), ``aux_hidden_state_layer_ids``
(indices into the target's HF ``hidden_states``, 0 = the embedding output: dspark's / DeepSpec's ids + 1),
``sample_from_anchor: true`` (the anchor slot predicts the next token, DeepSpec's convention),
``draft_vocab_size`` (N), ``mask_token_id``, ``block_size``, the Markov / confidence fields, and
``speculators_config`` (greedy proposal of ``block_size`` tokens, the verifier). Weight names are DeepSpec's.

A reduced draft vocabulary (``draft_vocab_size`` N < the target's V) is written as speculators writes one:
``d2t`` [N] int64 offsets (draft id i is target id ``i + d2t[i]``), ``t2d`` [V] bool (the kept target ids),
``lm_head.weight`` [N, Ht] (the target's LM head rows at those ids, ascending: speculators' loader reads the
draft's own head when it is reduced, vLLM requires it) and ``markov_head.markov_w2.weight`` [N, r]. W1 stays
over the target's V (the previous token is a target id).
"""

from __future__ import annotations

from typing import Any

import torch

from dspark_core.errors import UserError
from dspark_core.export.common import ForeignDraft, check_markov_type, draft_hf_fields, draft_params, head_fields

TARGET_COPIES = False  # embed_tokens / lm_head left out: taken from the verifier (see common.py)
NAME = "speculators"
MODEL_TYPE = "dspark"
SPECULATORS_VERSION = "0.9.0"


def build_config(draft: Any, dtype: str, target: str) -> dict[str, Any]:
    hf = {**draft_hf_fields(draft), "architectures": ["Qwen3ForCausalLM"], "torch_dtype": dtype}
    return {
        "speculators_model_type": MODEL_TYPE, "speculators_version": SPECULATORS_VERSION,
        "architectures": ["DSparkSpeculator"], "transformer_layer_config": hf, "torch_dtype": dtype,
        "draft_vocab_size": draft.cfg.vocab_size or draft.vocab_size, "block_size": draft.block_size,
        "target_hidden_size": draft.target_hidden_size, "mask_token_id": draft.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in draft.aux_layer_ids], "sample_from_anchor": True,
        "sliding_window_non_causal": False, **head_fields(draft),
        "speculators_config": {
            "algorithm": MODEL_TYPE, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft.block_size}],
            "verifier": {"name_or_path": target,
                         "architectures": list(getattr(draft.hf_config, "architectures", None) or [])},
        },
    }


def vocab_weights(draft: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``d2t`` / ``t2d`` / ``lm_head.weight`` of a reduced draft vocabulary (none for the full one)."""
    from dspark_core.draft.vocab import speculators_maps

    if draft.draft_vocab is None:
        return {}
    d2t, t2d = speculators_maps(draft.draft_vocab)  # [N] int64 offsets, [V] bool
    head = draft.draft_head_weight().detach().to("cpu", dtype).contiguous().clone()  # [N, Ht]
    return {"d2t": d2t.contiguous(), "t2d": t2d.contiguous(), "lm_head.weight": head}


def detect(config: dict[str, Any]) -> bool:
    return config.get("speculators_model_type") == MODEL_TYPE


def read(config: dict[str, Any], src: str) -> ForeignDraft:
    missing = [k for k in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id", "block_size")
               if k not in config]
    if missing:
        raise UserError(f"{src}: a speculators DSpark config needs {missing}")
    if config.get("sample_from_anchor") is not True:
        raise UserError(f"{src}: sample_from_anchor is {config.get('sample_from_anchor')!r}; dspark drafts "
                        "predict the next token from the anchor slot (sample_from_anchor: true) and cannot read "
                        "this draft")
    hf = config["transformer_layer_config"]
    n = config.get("draft_vocab_size") or hf.get("vocab_size")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= int(hf.get("vocab_size") or n):
        raise UserError(f"{src}: draft_vocab_size {n!r} must be an integer in [1, {hf.get('vocab_size')}] "
                        "(transformer_layer_config.vocab_size, the target's)")
    check_markov_type(config.get("markov_head_type"), src)
    conf = bool(config.get("enable_confidence_head", True))
    draft = draft_params(hf, block_size=config["block_size"], mask_token_id=config["mask_token_id"],
                         markov_rank=int(config.get("markov_rank", 256)), conf=conf,
                         conf_markov=conf and bool(config.get("confidence_head_with_markov", True)), src=src)
    if n != hf.get("vocab_size"):  # a reduced vocabulary: d2t / t2d in model.safetensors
        draft["vocab_size"] = n
    target = {"vocab_size": hf.get("vocab_size"),
              "hidden_size": config.get("target_hidden_size") or hf.get("hidden_size")}
    ids = tuple(int(i) - 1 for i in config["aux_hidden_state_layer_ids"])
    return ForeignDraft(draft=draft, aux_layer_ids=ids, target=target, hf=hf)
