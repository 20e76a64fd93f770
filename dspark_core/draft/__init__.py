"""The DSpark draft: config, model (training forward + inference API), heads, anchors, chunked loss, task.

Importing this package needs only torch and transformers (no zarr / dvclive / matplotlib). Drafts are saved and
loaded by ``dspark_core.checkpoint`` (``save_draft`` / ``load_draft``).
"""

from dspark_core.draft.config import DraftConfig, LossConfig
from dspark_core.draft.inference import ContextCache, DraftProposal
from dspark_core.draft.model import DSparkDraft, ExtraKV
from dspark_core.draft.task import DSparkTask, DSparkTrainModel
from dspark_core.draft import variants  # noqa: E402,F401  (last: registers every draft.kind)

__all__ = ["ContextCache", "DSparkDraft", "DSparkTask", "DSparkTrainModel", "DraftConfig", "DraftProposal",
           "ExtraKV", "LossConfig"]
