"""Directory-to-directory glue of ``dspark export`` / ``dspark import`` and the ``export`` stage."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dspark_core.export import export_draft, load_any_draft


def _target(target_dir: Path):
    from dspark_core.target import load_target, read_fingerprint

    model, _ = load_target(target_dir, dtype="float32")
    fingerprint = read_fingerprint(target_dir)["fingerprint"] if (target_dir / "fingerprint.json").is_file() else None
    return model, fingerprint


def export_dir(draft_dir: str | Path, out_dir: str | Path, layouts: Sequence[str], dtype: str = "bfloat16",
               target_dir: str | Path = "data/target", variant: str = "draft") -> list[Path]:
    """Export the saved draft ``draft_dir`` (made on ``target_dir``) once per layout: ``out_dir/<layout>/`` when
    several layouts are asked, ``out_dir`` itself for one."""
    target_dir = Path(target_dir)
    model, fingerprint = _target(target_dir)
    draft = load_any_draft(draft_dir, model, expected_fingerprint=fingerprint)
    out = Path(out_dir)
    return [export_draft(draft, out / layout if len(layouts) > 1 else out, layout, dtype, str(target_dir), variant)
            for layout in layouts]


def import_dir(src_dir: str | Path, out_dir: str | Path, target_dir: str | Path = "data/target") -> Path:
    """A DeepSpec- or speculators-layout draft saved as a dspark checkpoint (what eval_offline / bench_online
    read), checked against the target ``target_dir``."""
    from dspark_core.draft.model import save_draft

    model, fingerprint = _target(Path(target_dir))
    draft = load_any_draft(src_dir, model, expected_fingerprint=fingerprint)
    draft.target_fingerprint = fingerprint
    return save_draft(out_dir, draft)
