"""Tiny randomly-initialised targets for tests and smoke runs (no hub, no downloads).

``tiny_target(family)`` builds a Qwen3 / Qwen2 / Llama ``*ForCausalLM`` with a few layers and a
byte-level tokenizer (256 byte tokens + specials) that has a chat template, so every stage
(regenerate, cache, train, decode) runs on it exactly as on a real model.
``save_tiny_target(dir, family)`` writes it as a plain HF directory.

Shape legend: V vocab, H hidden, L layers.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen2", "llama")

# Qwen3-4B's shapes (benchmarks build random models and inputs of this size; nothing is downloaded).
QWEN3_4B_SHAPES = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)
# Qwen3-8B's: wider (4096 / 12288), the same 36 layers and heads, an untied LM head.
QWEN3_8B_SHAPES = {**QWEN3_4B_SHAPES, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}

# Specials appended after the 256 byte tokens.
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|pad|>")
BYTE_VOCAB = 256
TINY_VOCAB = BYTE_VOCAB + len(SPECIALS)  # 261; the model's vocab is padded to 272
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A Qwen3-style template (written for the tests, same behaviour): an answer's ``<think>...</think>`` block is
# dropped from the history (answers before the last user turn) and kept, in a think block, for an answer after
# it; ``enable_thinking=false`` puts an empty think block after the generation prompt. ``<think>`` and
# ``</think>`` are tokens of the tokenizer (``tiny_tokenizer("qwen3")``), not special ones (decoding keeps them).
THINK_TOKENS = ("<think>", "</think>")
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}{%- set thought = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and (loop.last or thought) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)
TEMPLATES = ("simple", "qwen3")


def tiny_config(family: str = "qwen3", **overrides):
    """A small HF config of ``family``; ``overrides`` replace any field (e.g. num_hidden_layers)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}; got {family!r}")
    common = dict(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=256 + SPECIALS.index("<|im_end|>"),
        pad_token_id=256 + SPECIALS.index("<|pad|>"),
        torch_dtype="float32",
    )
    if family == "qwen3":
        cfg = Qwen3Config(**{"head_dim": 16, "rope_theta": 10000.0, **common, **overrides})
    elif family == "qwen2":
        cfg = Qwen2Config(**{"rope_theta": 10000.0, **common, **overrides})
    else:
        cfg = LlamaConfig(**{"head_dim": 16, "rope_theta": 10000.0, **common, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(family: str = "qwen3", seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager")
    # Random init of HF uses std=0.02, which makes every distribution nearly uniform; a larger
    # scale gives peaked, seed-dependent distributions so tests can tell tokens apart.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    return model.eval()


def tiny_tokenizer(template: str = "simple"):
    """Byte-level BPE with no merges: 256 byte tokens, then the specials. Has a chat template: ``simple``
    (:data:`CHAT_TEMPLATE`) or ``qwen3`` (:data:`QWEN3_CHAT_TEMPLATE`, with ``<think>`` / ``</think>`` as the
    tokens after the specials)."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}; got {template!r}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for j, s in enumerate(SPECIALS):
        vocab[s] = BYTE_VOCAB + j
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    fast.eos_token = "<|im_end|>"
    fast.pad_token = "<|pad|>"
    fast.chat_template = CHAT_TEMPLATE
    if template == "qwen3":
        fast.add_tokens(list(THINK_TOKENS))
        fast.chat_template = QWEN3_CHAT_TEMPLATE
    return fast


def save_tiny_target(path: str | Path, family: str = "qwen3", seed: int = 0, *, template: str = "simple",
                     **overrides) -> Path:
    """Write a tiny random target (weights + config + tokenizer with the chat template ``template``) as a plain
    HF directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_model(family, seed=seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(template).save_pretrained(path)
    return path


NAN_TOKEN = 7  # write_regen never draws it, except in the ``poison`` row (tests make it produce NaN)


def write_regen(path: str | Path, lengths: list[tuple[int, int]], seed: int = 0, poison: int | None = None,
                vocab: int = 256, spans: dict[int, list[tuple[int, int]]] | None = None) -> Path:
    """A regenerate parquet of random token ids in ``(NAN_TOKEN, vocab)``; ``lengths`` = (prompt, response)
    tokens per row. ``poison``: the row that gets ``NAN_TOKEN`` as its 3rd token. ``spans``: {row: loss spans}
    written as the ``span_starts`` / ``span_ends`` columns (the other rows' null: the response)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                        ("response_ids", pa.list_(pa.int32())), ("prompt_text", pa.string()),
                        ("response_text", pa.string()), ("backend", pa.string()), ("finish_reason", pa.string())])
    g = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in schema.names}
    for i, (p, r) in enumerate(lengths):
        prompt = g.integers(NAN_TOKEN + 1, vocab, size=p).tolist()
        if i == poison:
            prompt[2] = NAN_TOKEN
        rows["id"].append(f"s{i:03d}")
        rows["source"].append("test")
        rows["prompt_ids"].append(prompt)
        rows["response_ids"].append(g.integers(NAN_TOKEN + 1, vocab, size=r).tolist())
        rows["prompt_text"].append("p")
        rows["response_text"].append("r")
        rows["backend"].append("hf")
        rows["finish_reason"].append("length")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(rows, schema=schema)
    if spans is not None:
        for k, name in enumerate(("span_starts", "span_ends")):
            col = [[int(pair[k]) for pair in spans[i]] if i in spans else None for i in range(len(lengths))]
            table = table.append_column(name, pa.array(col, pa.list_(pa.int32())))
    pq.write_table(table, path, write_page_checksum=True)
    return path


def save_hub_repo(cache_dir: str | Path, repo_id: str, src_dir: str | Path, ref: str = "main",
                  commit: str | None = None, repo_type: str = "model") -> str:
    """Lay the files of ``src_dir`` (a tiny target's HF dir, or a data set's files with ``repo_type="dataset"``)
    out as huggingface_hub's cache holds a downloaded repository, so that hub targets and data sets are tested
    offline: ``<cache_dir>/models--org--name/blobs/<sha256>`` (``datasets--org--name``), ``snapshots/<commit>/<file>``
    as relative symlinks to those blobs, ``refs/<ref>`` holding the commit (default: a 40-hex hash of the files).
    Several calls add commits to one repository; returns the commit."""
    import hashlib
    import os

    src = Path(src_dir)
    repo = Path(cache_dir) / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    files = sorted(f for f in src.rglob("*") if f.is_file())
    digests = {f.relative_to(src).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    commit = commit or hashlib.sha1(repr(sorted(digests.items())).encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            blob.write_bytes((src / rel).read_bytes())
        link = repo / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


def scratch_env(repo: str | Path) -> dict[str, str]:
    """The environment of a git / DVC command in a scratch repo made by :func:`cache_stage_repo`: this Python's
    ``dvc`` on PATH, the repo's own ``dspark_core`` first on PYTHONPATH (a stage run by DVC imports it), offline,
    no analytics, no progress bars, a git identity."""
    import os
    import sys

    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                PYTHONPATH=str(repo), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DVC_NO_ANALYTICS="1",
                TQDM_DISABLE="1", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                GIT_COMMITTER_EMAIL="t@t")


def cache_stage_repo(repo: str | Path, stage: dict, target: str | Path, regen: str | Path, params: dict,
                     link_config: bool = True) -> Path:
    """A git + DVC repo at ``repo`` whose only stage is ``stage`` (as dvc.yaml's ``cache``), with this project's
    ``stages/cache.py`` and ``dspark_core``, ``target`` as ``data/target``, ``regen`` as
    ``data/regen/train.parquet`` (a hard link) and ``params`` as params.yaml; this project's ``.dvc/config`` (its
    link type) when ``link_config``, else DVC's defaults."""
    import os
    import shutil
    import subprocess
    import sys

    import yaml

    root, repo = Path(__file__).resolve().parents[1], Path(repo)
    repo.mkdir(parents=True)
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=repo, env=scratch_env(repo), check=True, capture_output=True)
    if link_config:
        shutil.copy(root / ".dvc" / "config", repo / ".dvc" / "config")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"cache": stage}}))
    (repo / "stages").mkdir()
    shutil.copy(root / "stages" / "cache.py", repo / "stages" / "cache.py")
    shutil.copytree(root / "dspark_core", repo / "dspark_core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(target, repo / "data" / "target")
    (repo / "data" / "regen").mkdir(parents=True)
    os.link(regen, repo / "data" / "regen" / "train.parquet")
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    return repo
