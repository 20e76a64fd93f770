"""The static AR decoder (``StaticARDecoder``: step + argmax + position update on the device) against
``ARDecoder``, and the static speculative engine running one cycle ahead of the host (the ring of host
copies used with CUDA graphs) against AR. On CPU both run their device code eagerly; the ring's depth-2
schedule is forced on, so its bookkeeping (stops, max_new_tokens, wasted in-flight cycles) is tested here."""

from __future__ import annotations

import pytest
import torch

from _decoding_utils import one_thread  # noqa: F401 (fixture)
from dspark_core.draft import DraftConfig, DSparkDraft
from dspark_core.decoding.ar import ARDecoder, StaticARDecoder
from dspark_core.decoding.sampling import SamplingParams
from dspark_core.decoding.static_engine import StaticSpeculativeDecoder
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _model(family: str = "qwen3", vocab: int = 16):
    torch.manual_seed(0)
    return tiny_model(family, vocab_size=vocab, eos_token_id=None, pad_token_id=None, num_hidden_layers=4)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_static_ar_matches_ar(family):
    model = _model(family, vocab=64)
    runner = TargetRunner(model, max_len=80)
    full = ARDecoder(runner).generate(PROMPT, 40).tokens
    stop = full[17]
    for sync_every in (1, 3, 8):
        static = StaticARDecoder(runner, sync_every=sync_every)
        for prompt, max_new, stops in ((PROMPT, 40, ()), (PROMPT, 40, (stop,)), ([5, 2], 7, ()), (PROMPT, 1, ())):
            ref = ARDecoder(runner).generate(prompt, max_new, stops)
            res = static.generate(prompt, max_new, stops)
            assert res.tokens == ref.tokens and res.stop_reason == ref.stop_reason
            assert res.cycles == len(res.tokens) - 1 or res.tokens[-1] in stops
            assert runner.length == len(prompt) + len(res.tokens) - 1
    assert StaticARDecoder(runner).generate(PROMPT, 40, (stop,)).tokens == full[: full.index(stop) + 1]


def test_static_ar_refuses_bad_input():
    runner = TargetRunner(_model(), max_len=32)
    with pytest.raises(ValueError, match="greedily"):
        StaticARDecoder(runner, sampling=SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="sync_every"):
        StaticARDecoder(runner, sync_every=0)
    with pytest.raises(ValueError, match="max_len"):
        StaticARDecoder(runner).generate(PROMPT, 30)


def _draft(model, block: int = 4):
    torch.manual_seed(1)
    cfg = DraftConfig(num_draft_layers=2, block_size=block, mask_token_id=None, num_anchors=4, markov_rank=8)
    return DSparkDraft(cfg, model.config, model.get_input_embeddings().weight,
                       model.get_output_embeddings().weight, aux_layer_ids=(0, 2)).eval()


@pytest.mark.parametrize("time_every", [0, 3])
def test_one_cycle_ahead_matches_ar(monkeypatch, time_every):
    """Depth 2 (what CUDA graphs use): same tokens and cycle records as depth 1 and as AR, for stops inside
    a cycle, max_new_tokens cuts, and repeated prompts (the wasted in-flight cycle leaves nothing behind)."""
    model = _model()
    draft = _draft(model)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    full = ARDecoder(runner).generate(PROMPT, 40).tokens
    cases = [(PROMPT, 40, ()), (PROMPT, 40, (full[21],)), ([7, 7, 2], 13, ()), (PROMPT, 2, ()), (PROMPT, 40, ())]
    depth1 = StaticSpeculativeDecoder(runner, draft, time_every=time_every)
    expected = [(ARDecoder(runner).generate(*c).tokens, depth1.generate(*c)) for c in cases]
    monkeypatch.setattr(StaticSpeculativeDecoder, "_depth", lambda self: 2)
    depth2 = StaticSpeculativeDecoder(runner, draft, time_every=time_every)
    for case, (ar_tokens, one) in zip(cases, expected):
        res = depth2.generate(*case)
        assert res.tokens == ar_tokens == one.tokens
        assert res.accepted_per_cycle == one.accepted_per_cycle and res.cycles == one.cycles
        assert len(res.draft_s) == len(one.draft_s)
        assert runner.length == len(case[0]) + len(res.tokens) - 1
    assert sum(r.cycles for _, r in expected) > len(cases)  # several cycles per generation: the ring is exercised
    with pytest.raises(ValueError, match="lookahead"):  # two cycles in flight need two blocks of room
        depth2.generate(PROMPT, 96 - len(PROMPT) - 6)
