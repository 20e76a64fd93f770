"""``dspark profile check NAME``: a profile checked as every stage would check it, downloading nothing.

The profile is merged onto a copy of params.yaml (as ``dspark profile apply`` would write it), then:

- every section is read through its stage's own ``Section`` class (the errors a stage would stop on, each as one
  line), every variant's merged ``draft`` / ``loss`` / ``train`` and ``warm_start``, the ``variant_dag``, and
  dvc.yaml resolved against the merged params (foreach, ``${...}``, a dependency cycle);
- where the target's ``config.json`` can be read without a download (a hub target already in the hub cache, a
  local HF dir, or ``data/target`` built), what depends on its dims: the aux layer ids, the MASK id, the DMTD split;
- it lists what the pipeline would download (the target's repository and revision, the ``hf:`` data sets) and
  estimates the bytes of the hidden-state cache for a token count (``cache.store.estimate_cache_bytes``: the
  target's hidden size, the aux layers, the aux dtype; ``--samples`` / ``--tokens-per-sample`` or ``--tokens``,
  else the prepare split sizes x ``cache.max_length``, an upper bound since every sample is cut to it), and how
  many times it will be on disk (``cache.home.dvc_copies``: once when DVC hard-links the store into its cache, as
  the repository's ``cache.type: hardlink,symlink`` does; twice when it copies it).

``check_profile(...) -> ProfileCheck`` (``problems``: one line each; ``lines``: the report) is what the CLI prints.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from dspark_core.config import read_yaml
from dspark_core.errors import UserError

# zstd keeps bf16 activations at about this share of their raw bytes (reports/cache_stats.json:
# hidden_compression_ratio of the default pipeline's stores, 0.71); an expectation, not a bound
TYPICAL_COMPRESSION = 0.7


@dataclasses.dataclass
class ProfileCheck:
    problems: list[str] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)

    def attempt(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None with its one-line error recorded under ``what``."""
        try:
            return fn()
        except UserError as e:
            self.problems.append(f"{what}: {e}")
            return None


def _section_loaders() -> list[tuple[str, Callable[[Path], Any]]]:
    """(params section, the stage's own reader of it): what each stage reads before it starts."""
    from dspark_core.bench.online import BenchOnlineConfig
    from dspark_core.cache.build import CacheConfig
    from dspark_core.data.prompts import PrepareConfig
    from dspark_core.data.regenerate import RegenerateConfig
    from dspark_core.dmtd.config import DMTDConfig
    from dspark_core.draft.eval_offline import EvalOfflineConfig
    from dspark_core.draft.vocab import DraftVocabConfig
    from dspark_core.export.run import ExportConfig
    from dspark_core.target import TargetConfig
    from dspark_core.train.trainer import TrainConfig

    def prepare(p: Path):
        cfg = PrepareConfig.load(p, "prepare")
        cfg.train_counts(), cfg.eval_draws()  # every source name parsed, the draws sized
        return cfg

    return [("target", lambda p: TargetConfig.load(p, "target")), ("prepare", prepare),
            ("regenerate", lambda p: RegenerateConfig.load(p, "regenerate")),
            ("cache", lambda p: CacheConfig.load(p, "cache")),
            ("draft_vocab", lambda p: DraftVocabConfig.load(p, "draft_vocab")),
            ("eval_offline", lambda p: EvalOfflineConfig.load(p, "eval_offline")),
            ("export", lambda p: ExportConfig.load(p, "export")),
            ("bench_online", lambda p: BenchOnlineConfig.load(p, "bench_online")),
            ("dmtd", lambda p: DMTDConfig.load(p, "dmtd")), ("dmtd_train", lambda p: TrainConfig.load(p, "dmtd_train"))]


def _check_variants(report: ProfileCheck, params: Path) -> dict[str, Any]:
    """Every variant's merged draft / loss / train and warm_start, and the variant DAG; {variant: DraftConfig}."""
    from dspark_core.draft.config import DraftConfig, WarmStartConfig
    from dspark_core.draft.stage import variant_configs
    from dspark_core.variants import check_variant_dag, section_for_variant

    report.attempt("variant_dag", lambda: check_variant_dag(params))
    drafts = {}
    for v in (read_yaml(params).get("variants") or {"baseline": {}}):
        report.attempt(f"variants.{v}", lambda v=v: variant_configs(params, v))
        report.attempt(f"variants.{v}.warm_start", lambda v=v: WarmStartConfig.from_dict(
            section_for_variant(params, "warm_start", v, optional=True, cls=WarmStartConfig), src=str(params),
            prefix="warm_start."))
        draft = report.attempt(f"variants.{v}", lambda v=v: DraftConfig.from_dict(  # its own, whatever train says
            section_for_variant(params, "draft", v, cls=DraftConfig), src=str(params), prefix="draft."))
        if draft is not None:
            drafts[v] = draft
    return drafts


def _check_dag(report: ProfileCheck, params: Path, dvc_yaml: Path) -> None:
    from dspark_core.pipeline import load_stages, plan

    stages = report.attempt("dvc.yaml", lambda: load_stages(dvc_yaml, params))
    if stages is not None:
        order = report.attempt("dvc.yaml", lambda: plan(stages))
        if order is not None:
            report.lines.append(f"dvc.yaml: {len(order)} stages resolve against the profile "
                                f"({', '.join(s.name for s in order[:6])}{', ...' if len(order) > 6 else ''})")


def target_config(sections: dict[str, Any], root: Path) -> tuple[dict | None, str]:
    """The target's config.json where it can be read without a download, and where it came from."""
    target = sections.get("target")
    if target is None:
        return None, "the target section is invalid"
    if target.source == "hf_hub":
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(target.model, "config.json", revision=target.revision)
        if isinstance(found, str):
            return json.loads(Path(found).read_text()), f"the hub cache ({target.model} @ {target.revision})"
        return None, (f"{target.model} @ {target.revision} is not in the hub cache (`hf download {target.model} "
                      "config.json` to check its dims without the weights)")
    local = Path(target.path) if target.source == "hf_dir" else root / target.out_dir
    if (local / "config.json").is_file():
        return json.loads((local / "config.json").read_text()), str(local)
    return None, f"{local}/config.json does not exist yet (the target stage writes it)"


def _check_dims(report: ProfileCheck, cfg: dict, sections: dict[str, Any], drafts: dict[str, Any]) -> None:
    """What a stage would refuse once it saw the target: aux layer ids, MASK ids, the DMTD split."""
    from dspark_core.cache.capture import check_layer_ids

    layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    cache = sections.get("cache")
    if cache is not None:
        report.attempt("cache", lambda: check_layer_ids(cache.aux_layer_ids, layers))
    for v, draft in drafts.items():
        if not 0 <= draft.mask_token_id < vocab:
            report.problems.append(f"variants.{v}: draft.mask_token_id {draft.mask_token_id} is outside the target's "
                                   f"vocabulary of {vocab}")
    dmtd = sections.get("dmtd")
    if dmtd is not None and not 0 < dmtd.num_parallel_layers < layers:
        report.problems.append(f"dmtd.num_parallel_layers {dmtd.num_parallel_layers} must be in 1..{layers - 1} for "
                               f"a {layers}-layer target")


def _downloads(sections: dict[str, Any]) -> list[str]:
    """What the pipeline would fetch from the hub: the target repository and the ``hf:`` data sets."""
    out = []
    target, prepare = sections.get("target"), sections.get("prepare")
    if target is not None and target.source == "hf_hub":
        code = ", its *.py (trust_remote_code)" if target.trust_remote_code else ""
        out.append(f"target: {target.model} @ {target.revision}: config, tokenizer, chat template, generation "
                   f"config and its safetensors weights{code}, into the hub cache (never into data/ or DVC)")
    if prepare is not None:
        names = [s for s, _ in prepare.mix()] + [d.source for d in prepare.eval_draws()]
        for name in dict.fromkeys(n for n in names if n.startswith("hf:")):
            out.append(f"data: {name} (datasets.load_dataset, streamed)")
    return out or ["nothing: the target and every source are local"]


def _estimate(report: ProfileCheck, cfg: dict | None, sections: dict[str, Any], samples: int | None,
              tokens_per_sample: int | None, tokens: int | None, train_hidden: str, root: Path) -> None:
    from dspark_core.cache.home import dvc_copies, existing_parent, home_dir
    from dspark_core.cache.store import TOKEN_BYTES, cache_bytes_per_token, human_bytes

    cache, prepare = sections.get("cache"), sections.get("prepare")
    if cache is None or cfg is None:
        report.lines.append("cache estimate: needs the target's hidden size (see above)")
        return
    if tokens is None:
        if samples is None and prepare is not None and prepare.n_train is not None:
            samples = prepare.n_train + sum(d.n for d in prepare.eval_draws())
        if samples is None:
            report.lines.append("cache estimate: the sample count is not fixed by the params (every usable record "
                                "trains); give --samples N (or --tokens N)")
            return
        per = tokens_per_sample or cache.max_length
        tokens = samples * per
        how = f"{samples:,} samples x {per:,} tokens ({'given' if tokens_per_sample else 'cache.max_length, at most'})"
    else:
        how = "given"
    hidden, k = int(cfg["hidden_size"]), len(cache.aux_layer_ids)
    per_token = cache_bytes_per_token(hidden, k, cache.aux_dtype)
    raw = tokens * per_token
    extra, why = dvc_copies(existing_parent(root / home_dir(cache)))
    copies = f"; on disk {'twice' if extra else 'once'} ({why}): {human_bytes(raw * (1 + extra))} raw" \
        if extra else f"; on disk once ({why})"
    report.lines.append(f"cache estimate: {tokens:,} tokens ({how}) x {per_token:,} bytes a token ({cache.aux_dtype} "
                        f"aux, {k} aux layers + the last, hidden {hidden}) = {human_bytes(raw)} raw, about "
                        f"{human_bytes(raw * TYPICAL_COMPRESSION)} compressed{copies}; train.hidden_states: online "
                        f"keeps {TOKEN_BYTES} bytes a token ({human_bytes(tokens * TOKEN_BYTES)}) instead "
                        f"(now: {train_hidden})")


def check_profile(name: str | None, params: Path = Path("params.yaml"), dvc_yaml: Path = Path("dvc.yaml"),
                  samples: int | None = None, tokens_per_sample: int | None = None, tokens: int | None = None,
                  profiles_dir: Path | None = None) -> ProfileCheck:
    """Check profile ``name`` (None: params.yaml as it is) merged onto ``params``; see the module docstring."""
    from dspark_core.profiles import PROFILES_DIR, apply_profile

    report = ProfileCheck()
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "params.yaml"
        shutil.copy(params, merged)
        if name is not None:
            apply_profile(name, merged, profiles_dir or PROFILES_DIR)  # an unknown key: one line, raised
        sections = {s: report.attempt(s, lambda f=f: f(merged)) for s, f in _section_loaders()}
        drafts = _check_variants(report, merged)
        _check_dag(report, merged, dvc_yaml)
        root = Path(params).resolve().parent
        cfg, where = target_config(sections, root)
        report.lines.append(f"target config: {'read from ' if cfg else ''}{where}")
        if cfg is not None:
            _check_dims(report, cfg, sections, drafts)
        report.lines += [f"download: {d}" for d in _downloads(sections)]
        train_hidden = str((read_yaml(merged).get("train") or {}).get("hidden_states", "cache"))
        _estimate(report, cfg, sections, samples, tokens_per_sample, tokens, train_hidden, root)
    report.problems = list(dict.fromkeys(report.problems))  # a section every variant reads: named once
    return report
