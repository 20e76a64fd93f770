"""Directory-to-directory glue of ``dspark export`` / ``dspark import`` and the ``export`` stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dspark_core.config import ParamsError, Section, one_of, require
from dspark_core.export import export_draft, load_any_draft

TARGET_DIR, TRAIN_DIR, EXPORT_DIR = Path("data/target"), Path("data/train"), Path("data/export")


def _target(target_dir: Path):
    from dspark_core.target import load_target, read_fingerprint

    model, _ = load_target(target_dir, dtype="float32")
    fingerprint = read_fingerprint(target_dir)["fingerprint"] if (target_dir / "fingerprint.json").is_file() else None
    return model, fingerprint


def export_dir(draft_dir: str | Path, out_dir: str | Path, layouts: Sequence[str], dtype: str = "bfloat16",
               target_dir: str | Path = "data/target", variant: str = "draft", subdirs: bool = True) -> list[Path]:
    """Export the saved draft ``draft_dir`` (made on ``target_dir``) once per layout, to ``out_dir/<layout>/``
    (``subdirs``; else ``out_dir`` itself, for one layout)."""
    if not subdirs and len(layouts) != 1:
        raise ValueError(f"export_dir: subdirs=False needs one layout; got {list(layouts)}")
    target_dir = Path(target_dir)
    model, fingerprint = _target(target_dir)
    draft = load_any_draft(draft_dir, model, expected_fingerprint=fingerprint)
    out = Path(out_dir)
    return [export_draft(draft, out / layout if subdirs else out, layout, dtype, str(target_dir), variant)
            for layout in layouts]


@dataclass(frozen=True)
class ExportConfig(Section):
    """The ``export`` section: which variants' final drafts the ``export@<variant>`` stage writes, in which
    layouts (``data/export/<variant>/<layout>/``) and dtype."""

    variants: tuple[str, ...] = ("baseline",)
    layouts: tuple[str, ...] = ("deepspec", "speculators")
    dtype: str = "bfloat16"

    def validate(self) -> None:
        from dspark_core.export import LAYOUTS
        from dspark_core.export.common import DTYPES

        require(len(self.layouts) > 0, "layouts must not be empty")
        for layout in self.layouts:
            one_of("layouts", layout, LAYOUTS)
        one_of("dtype", self.dtype, DTYPES)


def run_export_stage(params: Path, variant: str) -> list[Path]:
    """``export@<variant>``: ``data/train/<variant>/final`` -> ``data/export/<variant>/<layout>/``."""
    cfg = ExportConfig.load(params, "export")
    if variant not in cfg.variants:
        raise ParamsError(f"{params}: export.variants {list(cfg.variants)} does not list {variant!r}")
    return export_dir(TRAIN_DIR / variant / "final", EXPORT_DIR / variant, cfg.layouts, cfg.dtype, TARGET_DIR,
                      variant)


def import_dir(src_dir: str | Path, out_dir: str | Path, target_dir: str | Path = "data/target") -> Path:
    """A DeepSpec- or speculators-layout draft saved as a dspark checkpoint (what eval_offline / bench_online
    read), checked against the target ``target_dir``."""
    from dspark_core.checkpoint import save_draft

    model, fingerprint = _target(Path(target_dir))
    draft = load_any_draft(src_dir, model, expected_fingerprint=fingerprint)
    draft.target_fingerprint = fingerprint
    return save_draft(out_dir, draft)
