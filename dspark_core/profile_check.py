"""``dspark profile check NAME``: a profile checked as every stage would check it, downloading nothing.

The profile is merged onto a copy of params.yaml (as ``dspark profile apply`` would write it), then:

- every section is read through its stage's own ``Section`` class (the errors a stage would stop on, each as one
  line), every variant's merged ``draft`` / ``loss`` / ``train`` and ``warm_start``, the ``variant_dag``, and
  dvc.yaml resolved against the merged params (foreach, ``${...}``, a dependency cycle);
- what depends on the target's dims (the aux layer ids, the MASK id, the DMTD split), against the target the
  profile names where its dims can be read without a download (a hub target's ``config.json`` in the hub cache, a
  local HF dir, a GGUF file's metadata), or against what the profile declares it needs (``target.requires``), never
  against the workspace's ``data/target``: a profile's check gives the same answer whatever target is built. A
  profile that does neither is a problem; for one that declares its needs, a line says whether the params' current
  target fits them;
- it lists what the pipeline would download (the target's repository and revision, the ``hf:`` data sets) and
  estimates the bytes of the hidden-state cache for a token count (``cache.store.estimate_cache_bytes``: the
  target's hidden size, the aux layers, the aux dtype; ``--samples`` / ``--tokens-per-sample`` or ``--tokens``,
  else the prepare split sizes x ``cache.max_length``: a sample a conversation, each cut to it, where a conversation
  split into a sample an answer makes more), and how many times it will be on disk (``cache.home.dvc_copies``: once
  when DVC hard-links the store into its cache, as the repository's ``cache.type: hardlink,symlink`` does; twice
  when it copies it);
- it compares the answers a conversation can hold (``regenerate.max_turns`` x ``max_new_tokens``) with
  ``cache.max_length`` and warns where regenerated answers would not be trained whole (:func:`turn_warnings`).

``check_profile(...) -> ProfileCheck`` (``problems``: one line each; ``warnings``: what a run would lose, one line
each; ``lines``: the report) is what the CLI prints.
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
    warnings: list[str] = dataclasses.field(default_factory=list)

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


def target_config(target: Any) -> tuple[dict | None, str]:
    """The dims of the target ``target`` (a ``TargetConfig``) names -- its config.json, or a GGUF file's metadata --
    where they can be read without a download, and where they came from (never the workspace's ``data/target``)."""
    from dspark_core.target import check_gguf_file, find_package_gguf, gguf_dims

    if target.source == "hf_hub":
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(target.model, "config.json", revision=target.revision)
        if isinstance(found, str):
            return json.loads(Path(found).read_text()), f"the hub cache ({target.model} @ {target.revision})"
        return None, (f"{target.model} @ {target.revision} is not in the hub cache (`hf download {target.model} "
                      "config.json` to check its dims without the weights)")
    if target.source == "hf_dir":
        local = Path(target.path) / "config.json"
        if local.is_file():
            return json.loads(local.read_text()), str(local.parent)
        return None, f"{local} does not exist"
    try:
        gguf = (find_package_gguf(target.gguf_package, target.gguf_file) if target.source == "smollm2_gguf" else
                check_gguf_file(target.path))
        return gguf_dims(gguf), f"the GGUF metadata of {gguf.name}"
    except UserError as e:
        return None, str(e)


def _check_dims(report: ProfileCheck, cfg: dict, sections: dict[str, Any], drafts: dict[str, Any]) -> None:
    """What a stage would refuse once it saw a target of ``cfg``'s dims (a config.json, or ``target.requires``
    with the least layers it allows; an unknown dim is None and not checked): aux layer ids, MASK ids, the DMTD
    split."""
    from dspark_core.cache.capture import check_layer_ids

    layers, vocab = cfg.get("num_hidden_layers"), cfg.get("vocab_size")
    cache, dmtd = sections.get("cache"), sections.get("dmtd")
    if layers is not None and cache is not None:
        report.attempt("cache", lambda: check_layer_ids(cache.aux_layer_ids, int(layers)))
    if vocab is not None:
        for v, draft in drafts.items():
            if not 0 <= draft.mask_token_id < vocab:
                report.problems.append(f"variants.{v}: draft.mask_token_id {draft.mask_token_id} is outside the "
                                       f"target's vocabulary of {vocab}")
    if layers is not None and dmtd is not None and not 0 < dmtd.num_parallel_layers < layers:
        report.problems.append(f"dmtd.num_parallel_layers {dmtd.num_parallel_layers} must be in 1..{layers - 1} for "
                               f"a {layers}-layer target")


def turn_warnings(regenerate: Any, cache: Any) -> list[str]:
    """What the cache would not train of the regenerated answers: with ``long_conversations: truncate``, the
    answers past ``cache.max_length`` of a conversation of ``max_turns`` answers of ``max_new_tokens``; with
    ``split``, the tail of an answer longer than ``max_length`` (and the context of one that fills it)."""
    turns, new, limit = regenerate.max_turns, regenerate.max_new_tokens, cache.max_length
    counted = "counted in reports/cache_stats.json: answers_cut, answer_tokens_lost"
    if cache.long_conversations == "truncate" and turns * new > limit:
        return [f"regenerate.max_turns x max_new_tokens = {turns} x {new:,} = {turns * new:,} answer tokens a "
                f"conversation can hold, against cache.max_length {limit:,}: with cache.long_conversations: truncate "
                f"a conversation keeps its first {limit:,} tokens and the answers past them are regenerated, then "
                f"not trained ({counted}); cache.long_conversations: split trains each answer"]
    if cache.long_conversations == "split" and new >= limit:
        longer = f", and a longer one is cut at its tail ({counted})" if new > limit else ""
        return [f"regenerate.max_new_tokens {new:,} >= cache.max_length {limit:,}: an answer of {limit:,} tokens "
                f"fills its sample alone, with none of its prompt{longer}; raise cache.max_length to keep long "
                "answers with their context"]
    return []


def _profile_target(report: ProfileCheck, name: str | None, named: bool, target: Any) -> dict | None:
    """The dims the profile is checked against: its own target's (read where possible), else its
    ``target.requires`` (with a line on whether the params' current target fits them); None: not known."""
    if target is None:
        report.lines.append("target config: the target section is invalid")
        return None
    requires = target.requires
    cfg, where = target_config(target)
    if named or not requires.declared:
        if name is not None and not named:
            report.problems.append(f"profile {name}: names no target (target.source and its model / path) and "
                                   "declares none it needs (target.requires): its check would depend on the "
                                   "workspace's target")
        report.lines.append(f"target config: {'read from ' if cfg else ''}{where}")
        if cfg is not None and requires.declared and requires.misfits(cfg):
            report.problems.append(f"target.requires: {target.label} has {', '.join(requires.misfits(cfg))}, but "
                                   f"the profile needs {requires.describe()}")
        return cfg
    report.lines.append(f"target: not named by the profile; the params are checked against what it needs: "
                        f"{requires.describe()} (target.requires)")
    if cfg is None:
        report.lines.append(f"target: the current target ({target.label}): its dims cannot be read here ({where})")
    elif requires.misfits(cfg):
        report.lines.append(f"target: the current target ({target.label}) does not fit this profile: it has "
                            f"{', '.join(requires.misfits(cfg))}; a target with {requires.describe()} would (set "
                            f"target.source and target.model / target.path to one)")
    else:
        report.lines.append(f"target: the current target ({target.label}) fits ({requires.describe()})")
    return {"num_hidden_layers": requires.min_layers, "vocab_size": requires.vocab_size,
            "hidden_size": requires.hidden_size}


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
    if cache is None or cfg is None or cfg.get("hidden_size") is None:
        report.lines.append("cache estimate: needs the target's hidden size (see above)")
        return
    if tokens is None:
        counted = samples is None  # the prepare sizes: conversations
        if samples is None and prepare is not None and prepare.n_train is not None:
            samples = prepare.n_train + sum(d.n for d in prepare.eval_draws())
        if samples is None:
            report.lines.append("cache estimate: the sample count is not fixed by the params (every usable record "
                                "trains); give --samples N (or --tokens N)")
            return
        per = tokens_per_sample or cache.max_length
        tokens = samples * per
        how = f"{samples:,} samples x {per:,} tokens ({'given' if tokens_per_sample else 'cache.max_length, at most'})"
        regen = sections.get("regenerate")
        if counted and cache.long_conversations == "split" and regen is not None and regen.max_turns > 1:
            how += f"; a sample a conversation: a split one makes more, up to {regen.max_turns}"
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
    from dspark_core.profiles import PROFILES_DIR, apply_profile, load_profile, names_target

    report = ProfileCheck()
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "params.yaml"
        shutil.copy(params, merged)
        named = True   # params.yaml as it is: its own target
        if name is not None:
            apply_profile(name, merged, profiles_dir or PROFILES_DIR)  # an unknown key: one line, raised
            named = names_target(load_profile(name, profiles_dir or PROFILES_DIR))
        sections = {s: report.attempt(s, lambda f=f: f(merged)) for s, f in _section_loaders()}
        drafts = _check_variants(report, merged)
        _check_dag(report, merged, dvc_yaml)
        root = Path(params).resolve().parent
        cfg = _profile_target(report, name, named, sections.get("target"))
        if cfg is not None:
            _check_dims(report, cfg, sections, drafts)
        report.lines += [f"download: {d}" for d in _downloads(sections)]
        train_hidden = str((read_yaml(merged).get("train") or {}).get("hidden_states", "cache"))
        _estimate(report, cfg, sections, samples, tokens_per_sample, tokens, train_hidden, root)
        if sections.get("regenerate") is not None and sections.get("cache") is not None:
            report.warnings += turn_warnings(sections["regenerate"], sections["cache"])
    report.problems = list(dict.fromkeys(report.problems))  # a section every variant reads: named once
    return report
