"""Reduced draft vocabulary (``draft.vocab_size``): the ranking stage, the maps, the reduced draft's loss,
inference and exactness of speculative decoding with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dspark_core.draft.vocab import (DraftVocab, count_tokens, coverage, rank_tokens, read_ranking,
                                     run_draft_vocab_stage, speculators_maps, top_ids)
from dspark_core.errors import UserError


# -- the ranking stage -----------------------------------------------------------------------------------------
def _stage_inputs(tmp_path: Path, answers: list[list[int]], vocab: int = 10, variants: dict | None = None) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    (target / "fingerprint.json").write_text(json.dumps({"fingerprint": "fp-test"}))
    pq.write_table(pa.table({"response_ids": answers}), tmp_path / "train.parquet")
    params = tmp_path / "params.yaml"
    doc = {"draft_vocab": {"report_sizes": [1, 3]}, "draft": {"vocab_size": None}, "variants": variants or {}}
    params.write_text(json.dumps(doc))  # JSON is YAML
    return params


def _run(tmp_path: Path, params: Path) -> dict:
    return run_draft_vocab_stage(params, target_dir=tmp_path / "target", regen=tmp_path / "train.parquet",
                                 out=tmp_path / "out" / "ranking.safetensors", report=tmp_path / "report.json")


def test_ranking_counts_answers_breaks_ties_by_id_and_records_coverage(tmp_path):
    # counts: 7 x4, 2 x2, 5 x2, 9 x1, 0 x1; ties (2, 5) and (0, 9) by the smaller id; unseen ids last by id
    answers = [[7, 7, 2, 5], [7, 9, 2], [5, 7, 0]]
    params = _stage_inputs(tmp_path, answers, variants={"small": {"draft": {"vocab_size": 5}}, "full": {}})
    stats = _run(tmp_path, params)
    order = read_ranking(tmp_path / "out" / "ranking.safetensors", 10, "fp-test")
    assert order.tolist() == [7, 2, 5, 0, 9, 1, 3, 4, 6, 8]
    assert stats["answer_tokens"] == 10 and stats["distinct_tokens"] == 5
    assert stats["coverage"] == {"1": 0.4, "3": 0.8, "5": 1.0}  # report_sizes + the variant's vocab_size
    assert json.loads((tmp_path / "report.json").read_text()) == stats
    assert top_ids(order, 3).tolist() == [2, 5, 7]  # ascending target ids


def test_ranking_refuses_foreign_ids_other_targets_and_bad_sizes(tmp_path):
    with pytest.raises(UserError, match="token id 12 outside the target vocabulary"):
        count_tokens([[1, 12]], 10)
    params = _stage_inputs(tmp_path, [[1, 2]])
    _run(tmp_path, params)
    path = tmp_path / "out" / "ranking.safetensors"
    with pytest.raises(UserError, match="ranking made for target fp-test"):
        read_ranking(path, 10, "another")
    with pytest.raises(UserError, match="ranking of 10 tokens, the target has 11"):
        read_ranking(path, 11)
    with pytest.raises(UserError, match="vocab_size 11 must be in"):
        top_ids(read_ranking(path, 10), 11)


def test_rank_and_coverage_reference():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, size=50)
    order = rank_tokens(counts)
    ref = sorted(range(50), key=lambda t: (-counts[t], t))
    assert order.tolist() == ref
    assert coverage(counts, order, 50) == 1.0
    assert coverage(counts, order, 7) == pytest.approx(counts[ref[:7]].sum() / counts.sum())


def test_maps_round_trip_and_speculators_layout():
    vocab = DraftVocab(10, 4)
    vocab.set_ids(torch.tensor([1, 4, 5, 9]))
    assert vocab.to_target(torch.arange(4)).tolist() == [1, 4, 5, 9]
    assert vocab.to_draft(torch.tensor([1, 2, 9])).tolist() == [0, -1, 3]
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    full = vocab.expand(x, float("-inf"))
    assert full[0, [1, 4, 5, 9]].tolist() == [1.0, 2.0, 3.0, 4.0] and torch.isinf(full).sum() == 6
    offsets, mask = speculators_maps(vocab)
    assert offsets.tolist() == [1, 3, 3, 6] and mask.dtype == torch.bool and mask.nonzero().flatten().tolist() == \
        [1, 4, 5, 9]
    with pytest.raises(UserError, match="strictly ascending"):
        vocab.set_ids(torch.tensor([4, 1, 5, 9]))
    with pytest.raises(UserError, match="3 ids; the draft has draft.vocab_size 4"):
        DraftVocab(10, 4).set_ids(torch.tensor([1, 2, 3]))
