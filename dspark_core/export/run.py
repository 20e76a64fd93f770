"""Directory-to-directory glue of ``dspark export`` / ``dspark import`` and the ``export`` stage."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dspark_core.config import ParamsError, Section, one_of, require
from dspark_core.errors import UserError
from dspark_core.export import export_draft, load_any_draft
from dspark_core.export.common import SKIPPED, check_exportable, check_replaceable

TARGET_DIR, TRAIN_DIR, EXPORT_DIR = Path("data/target"), Path("data/train"), Path("data/export")
UNSUPPORTED = ("skip", "error")


def _target(target_dir: Path):
    from dspark_core.frozen_target import load_frozen_target
    from dspark_core.target import read_fingerprint

    model, _ = load_frozen_target(target_dir, dtype="float32")  # config, embedding, LM head
    fingerprint = read_fingerprint(target_dir)["fingerprint"] if (target_dir / "fingerprint.json").is_file() else None
    return model, fingerprint


def export_dir(draft_dir: str | Path, out_dir: str | Path, layouts: Sequence[str], dtype: str = "bfloat16",
               target_dir: str | Path = "data/target", variant: str = "draft", subdirs: bool = True,
               unsupported: str = "error", verifier: str | None = None) -> list[Path]:
    """Export the saved draft ``draft_dir`` (made on ``target_dir``) once per layout, to ``out_dir/<layout>/``
    (``subdirs``; else ``out_dir`` itself, for one layout). ``unsupported="skip"``: a layout that cannot run
    the draft (``check_exportable``) gets ``<layout>/SKIPPED.txt`` with the reason instead, printed too.
    ``verifier``: the target's name as the export records it (speculators' ``verifier.name_or_path``, the
    README's serve command); None: :func:`default_verifier`."""
    if not subdirs and len(layouts) != 1:
        raise ValueError(f"export_dir: subdirs=False needs one layout; got {list(layouts)}")
    target_dir = Path(target_dir)
    model, fingerprint = _target(target_dir)
    draft = load_any_draft(draft_dir, model, expected_fingerprint=fingerprint)
    out = Path(out_dir)
    written = []
    for layout in layouts:
        dest = out / layout if subdirs else out
        try:
            if unsupported == "skip":
                check_exportable(draft, layout)
        except UserError as err:
            written.append(_skip(dest, str(err)))
            continue
        written.append(export_draft(draft, dest, layout, dtype, verifier or default_verifier(target_dir), variant))
    return written


def default_verifier(target_dir: str | Path) -> str:
    """The target's name an export records when none is given: a hub target's id (what ``vllm serve`` and
    speculators load), else ``target_dir`` as given."""
    from dspark_core.target import hub_record

    rec = hub_record(target_dir)
    return str(rec["model"]) if rec is not None else str(target_dir)


def _skip(dest: Path, reason: str) -> Path:
    """``dest/SKIPPED.txt`` holding why the layout was not written (atomically, replacing an older export)."""
    from dspark_core.target import atomic_dir

    print(f"skipped: {reason}", file=sys.stderr)
    check_replaceable(dest)
    with atomic_dir(dest) as tmp:
        (tmp / SKIPPED).write_text(f"Not exported: {reason}\n(params.yaml export.unsupported: skip)\n")
    return dest


@dataclass(frozen=True)
class ExportConfig(Section):
    """The ``export`` section: which variants' final drafts the ``export@<variant>`` stage writes, in which
    layouts (``data/export/<variant>/<layout>/``) and dtype."""

    variants: tuple[str, ...] = ("baseline",)
    layouts: tuple[str, ...] = ("deepspec", "speculators")
    dtype: str = "bfloat16"
    unsupported: str = "skip"  # a layout that cannot run this draft: skip (SKIPPED.txt says why) | error
    verifier: str | None = None  # the target's name in the export (speculators' verifier); None: a hub target's
    #                              id, else data/target

    def validate(self) -> None:
        from dspark_core.export import LAYOUTS
        from dspark_core.export.common import DTYPES

        require(len(self.layouts) > 0, "layouts must not be empty")
        for layout in self.layouts:
            one_of("layouts", layout, LAYOUTS)
        one_of("dtype", self.dtype, DTYPES)
        one_of("unsupported", self.unsupported, UNSUPPORTED)
        require(self.verifier is None or bool(str(self.verifier).strip()), "verifier must be null or a non-empty "
                "hub id / path")


def run_export_stage(params: Path, variant: str) -> list[Path]:
    """``export@<variant>``: ``data/train/<variant>/final`` -> ``data/export/<variant>/<layout>/``."""
    cfg = ExportConfig.load(params, "export")
    if variant not in cfg.variants:
        raise ParamsError(f"{params}: export.variants {list(cfg.variants)} does not list {variant!r}")
    return export_dir(TRAIN_DIR / variant / "final", EXPORT_DIR / variant, cfg.layouts, cfg.dtype, TARGET_DIR,
                      variant, unsupported=cfg.unsupported, verifier=cfg.verifier)


def import_dir(src_dir: str | Path, out_dir: str | Path, target_dir: str | Path = "data/target") -> Path:
    """A DeepSpec- or speculators-layout draft saved as a dspark checkpoint (what eval_offline / bench_online
    read), checked against the target ``target_dir``."""
    from dspark_core.checkpoint import save_draft

    model, fingerprint = _target(Path(target_dir))
    draft = load_any_draft(src_dir, model, expected_fingerprint=fingerprint)
    draft.target_fingerprint = fingerprint
    return save_draft(out_dir, draft)
