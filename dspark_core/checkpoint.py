"""Checkpoints on disk: saved drafts and the trainer's step folders, each checked on load.

Two layouts, both folders:

- a **draft** (:func:`save_draft` / :func:`load_draft`): ``model.safetensors`` (the draft's own weights, not the
  target's frozen copies), ``config.json`` (its config, aux layers and the target it was trained on);
- a **training checkpoint** (:func:`save_checkpoint` / :func:`load_checkpoint`): ``ckpt_root/step_XXXXXXXX/``
  with ``model.safetensors`` (every trainable parameter), the trainer's state (scheduler, step, RNG, optimizer) as
  ``state.safetensors`` (its tensors) + ``state.json`` (the rest, plain JSON), and ``ckpt_root/latest.json`` naming
  the newest. Nothing in a checkpoint is a pickle, so one pulled from a shared remote cannot run code when it is
  resumed; a step folder of the older layout (``state.pt``, a pickle) is read with ``torch.load(weights_only=True)``
  and refused, naming it, when it asks for anything beyond tensors, plain values and numpy's RNG array.

Each folder also holds ``manifest.json``: the size and SHA-256 of every other file, written last. Loading checks
them before reading a byte of weights, so a truncated copy, a torn download or a flipped bit is refused with a
message naming the file and what to do -- never loaded half. A folder without a manifest (written before
manifests existed) still loads, with a warning; see docs/DESIGN.md.

Every file is written to a temp name, flushed to disk (fsync) and renamed; a crash leaves the previous state.

Shape legend: none (tensors are saved and restored by name).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dspark_core.draft.config import DraftConfig
from dspark_core.draft.model import DSparkDraft, build_draft
from dspark_core.errors import UserError
from dspark_core.io import atomic_path, fsync_dir, fsync_path, read_json, sha256_file, write_json

CHECKPOINT_FORMAT = "dspark-draft"
CHECKPOINT_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "dspark-manifest"
_VERIFIED: set[tuple] = set()  # folders that passed, with (name, size, mtime) of the manifest and each file


# -- manifest: size + sha256 of each file ------------------------------------------------------------------------
def write_manifest(folder: Path, names: list[str]) -> Path:
    """Record the size and SHA-256 of ``folder/<name>`` for each name, in ``folder/manifest.json``."""
    files = {n: {"size": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)} for n in names}
    write_json(folder / MANIFEST, {"format": MANIFEST_FORMAT, "version": 1, "files": files})
    return folder / MANIFEST


def verify_manifest(folder: Path, fix: str, required: bool = False) -> bool:
    """Check every file ``folder/manifest.json`` lists; ``fix`` says what to do when one is wrong.

    Returns False (after a warning) when the folder has no manifest (saved before manifests existed); raises
    :class:`UserError` naming the file when one is missing, of another size or of another SHA-256, and when the
    manifest itself is missing but ``required`` (the folder's own record, e.g. latest.json, says one was written:
    deleting it must not switch the checks off)."""
    man = folder / MANIFEST
    if not man.is_file() and required:
        raise UserError(f"{man}: missing, though the checkpoint was saved with one (its files cannot be checked); "
                        f"{fix}")
    if not man.is_file():
        warnings.warn(f"{folder}: no {MANIFEST} (saved before checkpoints recorded checksums); loading it unchecked",
                      stacklevel=3)
        return False
    info = read_json(man)
    if not isinstance(info, dict) or info.get("format") != MANIFEST_FORMAT or not isinstance(info.get("files"), dict):
        raise UserError(f"{man}: not a {MANIFEST_FORMAT} file; {fix}")
    seen = (str(folder.resolve()), tuple(_stamp(folder / n) for n in [MANIFEST, *sorted(info["files"])]))
    if seen not in _VERIFIED:
        for name, want in info["files"].items():
            _check_file(folder / name, want, fix)
        _VERIFIED.add(seen)
    return True


def _stamp(path: Path) -> tuple:
    st = path.stat() if path.is_file() else None
    return (path.name, st.st_size, st.st_mtime_ns) if st else (path.name, None, None)


def _check_file(path: Path, want: dict[str, Any], fix: str) -> None:
    if not path.is_file():
        raise UserError(f"{path}: missing (listed in {MANIFEST}); {fix}")
    size = path.stat().st_size
    if size != want.get("size"):
        raise UserError(f"{path}: {size} bytes, {MANIFEST} records {want.get('size')} (truncated or replaced); {fix}")
    if sha256_file(path) != want.get("sha256"):
        raise UserError(f"{path}: SHA-256 differs from the one {MANIFEST} records (the file is damaged); {fix}")


def load_tensors(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """``load_file`` of a safetensors file, its parse errors turned into a :class:`UserError` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: cannot be read as safetensors ({str(e).splitlines()[0]}); {fix}") from None


def load_checked_weights(folder: Path, fix: str) -> dict[str, torch.Tensor]:
    """``folder/model.safetensors`` after :func:`verify_manifest` (warm starts and DMTD evaluation read it so)."""
    verify_manifest(folder, fix)
    return load_tensors(folder / "model.safetensors", fix)


# -- drafts ------------------------------------------------------------------------------------------------------
def draft_checkpoint_config(draft: DSparkDraft) -> dict[str, Any]:
    return {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "manifest": True,  # saved with a manifest.json: load_draft refuses the folder without it
        "draft": draft.cfg.to_dict(),
        "aux_layer_ids": list(draft.aux_layer_ids),
        "mask": {"token_id": draft.mask_token_id, "learned": draft.mask_embedding is not None},
        "target": {**draft.target_summary, "fingerprint": draft.target_fingerprint},
        "architecture": {"hidden_size": draft.hidden_size, "intermediate_size": draft.hf_config.intermediate_size,
                         "num_attention_heads": draft.hf_config.num_attention_heads,
                         "num_key_value_heads": draft.hf_config.num_key_value_heads,
                         "head_dim": draft.hf_config.head_dim, "tied_embeddings": draft.tied_embeddings},
    }


def save_draft(out_dir: str | Path, draft: nn.Module, cfg: DraftConfig | None = None) -> Path:
    """Write ``model.safetensors`` (the draft's own weights, not the target's copies), ``config.json`` and
    ``manifest.json`` (last: a save cut short leaves a manifest that the new files fail)."""
    from safetensors.torch import save_file

    draft = getattr(draft, "draft", draft)  # a DSparkTrainModel wraps the draft
    if not isinstance(draft, DSparkDraft):
        raise ValueError(f"save_draft: expected a DSparkDraft, got {type(draft).__name__}")
    if cfg is not None and cfg != draft.cfg:
        raise ValueError(f"save_draft: cfg {cfg} differs from the draft's own config {draft.cfg}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in draft.own_state_dict().items()}
    with atomic_path(out / "model.safetensors", ".safetensors") as tmp:
        save_file(weights, str(tmp), metadata={"format": CHECKPOINT_FORMAT})
    write_json(out / "config.json", draft_checkpoint_config(draft))
    write_manifest(out, ["model.safetensors", "config.json"])
    return out


def read_draft_config(path: str | Path) -> dict[str, Any]:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise UserError(f"{f}: not a DSpark draft checkpoint (no config.json)")
    try:
        info = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{f}: not valid JSON ({e})") from None
    if info.get("format") != CHECKPOINT_FORMAT or info.get("format_version") != CHECKPOINT_VERSION:
        raise UserError(f"{f}: format {info.get('format')!r} v{info.get('format_version')!r} is not "
                        f"{CHECKPOINT_FORMAT!r} v{CHECKPOINT_VERSION}")
    return info


def _draft_fix(path: Path) -> str:
    return f"retrain the draft or restore {path} (`dvc checkout`)"


def _check_draft_target(src: str, saved: dict[str, Any], target_model: nn.Module,
                        expected_fingerprint: str | None) -> None:
    tc = target_model.config
    where = getattr(tc, "_name_or_path", "") or ""  # the dir the target was loaded from (HF sets it)
    given = f"the given target ({where})" if where else "the given target"
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        have = getattr(tc, key, None) if key != "vocab_size" else target_model.get_output_embeddings().weight.shape[0]
        if saved.get(key) != have:
            raise UserError(f"{src}: draft trained for another target: its target.{key} is {saved.get(key)!r}, "
                            f"{given} has {have!r}; retrain the draft on this target")
    if expected_fingerprint is not None and saved.get("fingerprint") not in (None, expected_fingerprint):
        raise UserError(f"{src}: draft trained on target fingerprint {saved['fingerprint']}, {given} has "
                        f"fingerprint {expected_fingerprint}; retrain the draft on this target")


def load_draft(path: str | Path, target_model: nn.Module, expected_fingerprint: str | None = None) -> DSparkDraft:
    """Rebuild a saved draft on ``target_model`` (its config, embedding and LM head; same device/dtype), after
    checking its files against ``manifest.json`` and its target against ``target_model``."""
    path = Path(path)
    info = read_draft_config(path)
    src = str(path / "config.json")
    cfg = DraftConfig.from_dict(info["draft"], src=src, prefix="draft.")
    _check_draft_target(src, info["target"], target_model, expected_fingerprint)
    verify_manifest(path, _draft_fix(path), required=bool(info.get("manifest")))
    lm = target_model.get_output_embeddings().weight
    draft = build_draft(cfg, target_model.config, target_model.get_input_embeddings().weight, lm,
                        aux_layer_ids=info["aux_layer_ids"], target_fingerprint=info["target"].get("fingerprint"))
    weights = load_tensors(path / "model.safetensors", _draft_fix(path))
    own = draft.own_state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise UserError(f"{path / 'model.safetensors'}: weights do not match config.json "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for k, v in weights.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise UserError(f"{path / 'model.safetensors'}: {k} has shape {tuple(v.shape)}, "
                            f"expected {tuple(own[k].shape)}")
    draft.load_state_dict(weights, strict=False)
    return draft.to(device=lm.device, dtype=lm.dtype).eval()


# -- training checkpoints ----------------------------------------------------------------------------------------
def _trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, Any]:
    """The RNG states: torch's (and CUDA's) as uint8 tensors, Python's and numpy's Mersenne Twisters as plain
    lists and numbers (JSON, not pickles)."""
    version, mt, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    st = {"torch": torch.get_rng_state(),
          "python": {"version": version, "state": list(mt), "gauss_next": gauss_next},
          "numpy": {"kind": str(kind), "key": [int(k) for k in key], "pos": int(pos), "has_gauss": int(has_gauss),
                    "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    """Restore :func:`_rng_state`'s states (or the tuples an older ``state.pt`` holds)."""
    torch.set_rng_state(st["torch"])
    py, npy = st["python"], st["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]) if isinstance(py, dict) else py)
    if isinstance(npy, dict):
        npy = (npy["kind"], np.asarray(npy["key"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
               npy["cached_gaussian"])
    np.random.set_state(npy)
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(st["cuda"]))


# -- the trainer's state without pickle: tensors in safetensors, the rest in JSON ---------------------------------
STATE_TENSORS, STATE_JSON, LEGACY_STATE = "state.safetensors", "state.json", "state.pt"
STATE_FORMAT = "dspark-train-state"
_TENSOR, _TUPLE, _INT_KEYS = "__tensor__", "__tuple__", "__int_keys__"  # markers of what JSON has no type for


def encode_state(obj: Any, tensors: dict[str, torch.Tensor], path: str = "state") -> Any:
    """``obj`` (nested dicts / lists / tuples of tensors and plain values: a state dict) as JSON values; each
    tensor goes into ``tensors`` under its path and is written ``{"__tensor__": path}``, a tuple ``{"__tuple__":
    [...]}``, a dict with int keys (an optimizer's ``state``) ``{"__int_keys__": {"0": ...}}``. Anything else is a
    ``TypeError``: the state holds nothing JSON and safetensors cannot say exactly."""
    if torch.is_tensor(obj):
        tensors[path] = obj.detach().cpu().contiguous()
        return {_TENSOR: path}
    if isinstance(obj, dict):
        if obj and all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
            return {_INT_KEYS: {str(k): encode_state(v, tensors, f"{path}.{k}") for k, v in obj.items()}}
        for k in obj:
            if not isinstance(k, str) or k in (_TENSOR, _TUPLE, _INT_KEYS):
                raise TypeError(f"{path}: key {k!r} cannot be written as training state")
        return {k: encode_state(v, tensors, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [encode_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{path}: a {type(obj).__name__} cannot be written as training state")


def decode_state(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The inverse of :func:`encode_state`; a reference to a tensor ``tensors`` lacks is a :class:`UserError`."""
    if isinstance(obj, list):
        return [decode_state(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if set(obj) == {_TENSOR}:
        if obj[_TENSOR] not in tensors:
            raise UserError(f"{where}: names tensor {obj[_TENSOR]!r}, which {STATE_TENSORS} lacks")
        return tensors[obj[_TENSOR]]
    if set(obj) == {_TUPLE}:
        return tuple(decode_state(v, tensors, where) for v in obj[_TUPLE])
    if set(obj) == {_INT_KEYS}:
        return {int(k): decode_state(v, tensors, where) for k, v in obj[_INT_KEYS].items()}
    return {k: decode_state(v, tensors, where) for k, v in obj.items()}


def write_train_state(folder: Path, state: dict[str, Any]) -> list[str]:
    """``state`` as ``folder/state.safetensors`` + ``folder/state.json`` (same bytes for the same state); returns
    the file names."""
    from dspark_core.io import save_safetensors

    tensors: dict[str, torch.Tensor] = {}
    doc = {"format": STATE_FORMAT, "version": 1, "state": encode_state(state, tensors)}
    save_safetensors(tensors, folder / STATE_TENSORS, metadata={"format": STATE_FORMAT})
    write_json(folder / STATE_JSON, doc)
    return [STATE_TENSORS, STATE_JSON]


def read_train_state(folder: Path, fix: str = "delete the checkpoint") -> dict[str, Any]:
    """The trainer's state of a step folder: ``state.json`` + ``state.safetensors``, or an older folder's
    ``state.pt`` read without running code (:func:`_read_legacy_state`). ``fix``: what to do when it is bad."""
    doc_path = folder / STATE_JSON
    if not doc_path.is_file():
        if (folder / LEGACY_STATE).is_file():
            return _read_legacy_state(folder / LEGACY_STATE, fix)
        raise UserError(f"{folder}: no {STATE_JSON} (nor an older {LEGACY_STATE}): not a training checkpoint; {fix}")
    state = decode_state(_state_doc(doc_path, fix)["state"], load_tensors(folder / STATE_TENSORS, fix), str(doc_path))
    for key in ("step", "scheduler", "rng"):
        if key not in state:
            raise UserError(f"{doc_path}: no {key!r} entry; {fix}")
    return state


def _state_doc(path: Path, fix: str) -> dict[str, Any]:
    """``state.json``'s document, checked to be one (its tensors are not read)."""
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or not isinstance(doc.get("state"), dict):
        raise UserError(f"{path}: not a {STATE_FORMAT} file; {fix}")
    return doc


def _read_legacy_state(path: Path, fix: str) -> dict[str, Any]:
    """An older checkpoint's pickled ``state.pt`` through ``torch.load(weights_only=True)``: tensors, plain
    containers and numbers, plus the three numpy names its numpy RNG state needs (an array of uint32); a pickle
    asking for anything else (a function to call: code) is refused before it is run."""
    import pickle
    import re

    reconstruct = np.zeros(1).__reduce__()[0]  # numpy's array rebuilder, wherever this numpy keeps it
    allowed = [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        if hasattr(torch.serialization, "safe_globals"):  # torch >= 2.5: for this load only
            with torch.serialization.safe_globals(allowed):
                state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            torch.serialization.add_safe_globals(allowed)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"it asks for {found.group(1)}, which could run code" if found else str(e).splitlines()[0][:200]
        raise UserError(f"{path}: refused, not a plain training state ({what}); nothing of it was loaded or run. "
                        f"Restore the checkpoint from a source you trust, or {fix}") from None
    if not isinstance(state, dict) or not {"step", "scheduler", "rng"} <= set(state):
        raise UserError(f"{path}: not a dspark training state; {fix}")
    return state


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, opt, sched, keep: int,
                    optimizer: bool = True, clock: dict[str, float] | None = None) -> Path:
    """Write ``ckpt_root/step_{step:08d}`` atomically (temp dir, fsync, rename), then update ``latest.json`` (with
    ``clock``: the seconds a time-scheduled run has spent, see :func:`checkpoint_clock`).

    ``optimizer=False`` (the step that ends the lr schedule): no optimizer state -- nothing can continue a
    finished schedule (another ``total_steps`` is another run), and the state is twice the weights (AdamW);
    for a DMTD target that is 1 GB a variant, in the workspace and again in DVC's cache."""
    from safetensors.torch import save_file

    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp_step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous().cpu() for k, v in _trainable_state(model).items()}, str(tmp / "model.safetensors"))
    state = {"scheduler": sched.state_dict(), "step": step, "rng": _rng_state()}
    if optimizer:
        state["optimizer"] = opt.state_dict()
    names = ["model.safetensors", *write_train_state(tmp, state)]
    for name in names:
        fsync_path(tmp / name)
    write_manifest(tmp, names)
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    write_json(ckpt_root / "latest.json", {"step": step, "dir": final.name, "manifest": True, **(clock or {})})
    for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_clock(ckpt_root: Path) -> dict[str, float]:
    """What ``lr_schedule: time`` resumes from: ``{"spent_s", "origin_s"}`` of the latest checkpoint (the run's
    seconds so far, and where its schedule's clock started), or {} when there is none."""
    latest = ckpt_root / "latest.json"
    info = read_json(latest) if latest.is_file() else {}
    return {k: float(info[k]) for k in ("spent_s", "origin_s") if k in info}


def _restore_weights(d: Path, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(k for k, p in params.items() if p.requires_grad) - set(weights))
    if missing:
        raise UserError(f"{d}/model.safetensors: checkpoint lacks trainable parameters {missing[:3]}...: "
                        "it was made by another model config; delete the checkpoints folder to start over")
    for k, v in weights.items():
        if k not in params:
            raise UserError(f"{d}/model.safetensors: unknown parameter {k!r} (another model config?)")
        if params[k].shape != v.shape:
            raise UserError(f"{d}/model.safetensors: {k} has shape {tuple(v.shape)}, "
                            f"model expects {tuple(params[k].shape)}")
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v)


def _latest_dir(ckpt_root: Path) -> tuple[Path, str, bool] | None:
    """The latest step folder, what to do when it is damaged, and whether latest.json records that it was saved
    with a manifest (None without a checkpoint)."""
    latest = ckpt_root / "latest.json"
    if not latest.is_file():
        return None
    try:
        info = read_json(latest)
    except UserError as e:
        raise UserError(f"{e}; rewrite it as {{\"step\": N, \"dir\": \"step_0000000N\"}} naming an existing "
                        f"step folder of {ckpt_root}, or delete {ckpt_root} to start over") from None
    d = ckpt_root / str(info.get("dir"))
    fix = f"delete {d} and point {latest} at an earlier step, or delete {ckpt_root} to start over"
    if not d.is_dir():
        raise UserError(f"{latest}: names {d.name}, which does not exist; point it at an existing step_* folder "
                        f"of {ckpt_root}, or delete {ckpt_root} to start over")
    return d, fix, bool(info.get("manifest"))


def verify_latest_checkpoint(ckpt_root: Path) -> None:
    """Check the latest checkpoint's files against its manifest, and that its training state can be read without
    running code (a run checks before it writes anything)."""
    found = _latest_dir(ckpt_root)
    if found is not None:
        d, fix, required = found
        verify_manifest(d, fix, required)
        if (d / STATE_JSON).is_file():
            _state_doc(d / STATE_JSON, fix)
        else:
            read_train_state(d, fix)  # an older state.pt: refused here when its pickle asks for code


def load_checkpoint(ckpt_root: Path, model: nn.Module, opt, sched, total_steps: int | None = None) -> int:
    """Restore the latest checkpoint; return the step to continue from (0 when there is none).

    Its files are checked against its ``manifest.json`` first: a damaged checkpoint changes nothing.
    A checkpoint saved without optimizer state (the schedule's last step) restores only at or past
    ``total_steps``: the run is complete and nothing is trained."""
    found = _latest_dir(ckpt_root)
    if found is None:
        return 0
    d, fix, required = found
    verify_manifest(d, fix, required)
    weights = load_tensors(d / "model.safetensors", fix)
    st = read_train_state(d, fix)
    if "optimizer" not in st and total_steps is not None and int(st["step"]) < total_steps:
        raise UserError(f"{d}: saved at the end of a {st['step']}-step schedule, without optimizer "
                        f"state, so it cannot continue to total_steps={total_steps}; delete {ckpt_root} to "
                        "start over")
    _restore_weights(d, model, weights)
    sched.load_state_dict(st["scheduler"])
    if "optimizer" in st:
        opt.load_state_dict(st["optimizer"])
        _set_rng_state(st["rng"])
    return int(st["step"])
