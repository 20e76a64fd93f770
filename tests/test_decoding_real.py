"""The engine on the real packaged SmolLM2 (slow): the static-cache runner equals HF's own greedy
``generate``, and greedy speculative decoding equals AR token for token, with a DSpark draft trained a few
steps on the target's own answers and with a noisy draft, both partly right (every run accepts some draft
tokens and rejects others)."""

from __future__ import annotations


import pytest
import torch

from _fake_draft import FakeDraft
from _decoding_utils import assert_partial_acceptance, fit_draft_to_target
from _decoding_utils import one_thread  # noqa: F401 (fixture)
from dspark_core.bench.online import chat_ids, stop_ids_of
from dspark_core.draft import DraftConfig, DSparkDraft
from dspark_core.decoding.ar import ARDecoder
from dspark_core.decoding.engine import SpeculativeDecoder
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.types import CycleInfo
from dspark_core.target import load_target

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?",
    "Write a haiku about the sea.",
]
NEW = 24
BLOCK = 5
FIT_STEPS = 60  # training steps of the DSpark draft on the target's answers: partly right (1 < MAL < BLOCK + 1)


@pytest.fixture(scope="module")
def real(packaged_target):
    model, tok = load_target(packaged_target)
    prompts = [chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return model, tok, prompts


def test_runner_matches_hf_generate_and_spec_matches_ar(real):
    model, tok, prompts = real
    torch.manual_seed(0)
    cfg = DraftConfig(num_draft_layers=1, block_size=BLOCK, mask_token_id=16, num_anchors=4, markov_rank=16)
    dspark = DSparkDraft(cfg, model.config, model.get_input_embeddings().weight,
                         model.get_output_embeddings().weight, aux_layer_ids=(1, 14, 27)).eval()
    aux = (-1, 1, 14, 27)  # -1 lets the noisy test draft read tokens back
    runner = TargetRunner(model, max_len=256, aux_layer_ids=aux)
    stops = stop_ids_of(model, tok)
    noisy = FakeDraft(model, embed_weight=model.get_input_embeddings().weight, embed_aux_index=0, block_size=BLOCK,
                      noise=2.0, seed=1)

    def check(info: CycleInfo) -> None:
        assert info.target_length == info.draft_context_length == info.next_anchor_position

    ars = [ARDecoder(runner).generate(prompt, NEW, stops) for prompt in prompts]
    # a random DSpark draft is never right on a 49k vocabulary: trained a few steps on the target's answers it is
    fit_draft_to_target(dspark, model, prompts, [ar.tokens for ar in ars], FIT_STEPS)
    dspark_runner = TargetRunner(model, max_len=256, aux_layer_ids=dspark.aux_layer_ids)
    for prompt, ar in zip(prompts, ars):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=stops,
                                pad_token_id=tok.pad_token_id or stops[0])
        assert hf[0, len(prompt):].tolist() == ar.tokens
        for name, run, draft in (("noisy", runner, noisy), ("dspark", dspark_runner, dspark)):
            spec = SpeculativeDecoder(run, draft, block_size=BLOCK, on_cycle=check).generate(prompt, NEW, stops)
            assert spec.tokens == ar.tokens, name
            assert_partial_acceptance(spec, BLOCK)  # this draft, this prompt: some tokens accepted, some rejected
            assert any(0 < a < n for a, n in zip(spec.accepted_per_cycle, spec.proposal_lengths)), name
