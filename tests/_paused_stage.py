"""Run a stage's command line (``stages/<name>.py``) and hold it still once part of its output is on disk, so a
test can ``kill -9`` it at a known point:

    python tests/_paused_stage.py MARKER regenerate|cache|train|export [stage args...]

- regenerate: as it is about to write its second answered batch (the first is a part file already);
- cache: as it is about to commit its second batch (that batch's chunks written, the manifest not updated);
- train: as it is about to write its second checkpoint (steps after the first checkpoint trained, not saved);
- export: as it is about to write its second layout's weights (the first layout's directory complete).

On reaching that point it creates the file MARKER and sleeps (the test kills it there).
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def hold_at_call(owner: object, name: str, calls_before: int, marker: Path) -> None:
    """``owner.name`` runs ``calls_before`` times, then the next call marks ``marker`` and sleeps."""
    real = getattr(owner, name)
    count = [0]

    def held(*args, **kwargs):
        count[0] += 1
        if count[0] > calls_before:
            marker.touch()
            time.sleep(600)
        return real(*args, **kwargs)

    setattr(owner, name, held)


def main() -> None:
    marker, stage, *args = sys.argv[1:]
    if stage == "regenerate":
        from dspark_core.data import regenerate as owner
        hold_at_call(owner.PartStore, "write", 1, Path(marker))
    elif stage == "cache":
        from dspark_core.cache import build as owner
        hold_at_call(owner, "commit", 1, Path(marker))
    elif stage == "train":
        from dspark_core.train import trainer as owner
        hold_at_call(owner, "save_checkpoint", 1, Path(marker))
    elif stage == "export":
        import safetensors.torch as owner
        hold_at_call(owner, "save_file", 1, Path(marker))
    else:
        raise SystemExit(f"unknown stage {stage!r}")
    sys.argv = [str(REPO / "stages" / f"{stage}.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
