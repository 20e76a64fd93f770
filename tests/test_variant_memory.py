"""Draft Memory (seed 000): stage 1 against a step-by-step greedy loop, the seed's C -> F example by hand, dropped
transitions, training forward with memory == single-block inference, gradients only through stage 2, the
parameter count at seed shapes, and the online engine (greedy output identical to AR with partial acceptance;
the memory fed at cycle k is the kept suffix of cycle k-1's states at their predicted positions, in both modes)."""

from __future__ import annotations

import pytest
import torch

from _draft_utils import seed000_param_counts
from dspark_core.cache.dataset import CacheCollator
from dspark_core.draft.anchors import add_anchor_fields, block_targets
from dspark_core.draft.config import DraftConfig, LossConfig, MemoryConfig
from dspark_core.draft.synthetic import items_from_target
from dspark_core.draft.model import build_draft
from dspark_core.draft.variants.memory import MEMORY_KEYS, DraftMemory, first_mismatch, memory_slots, transition
from dspark_core.testing import tiny_model

AUX = (0, 2, 4)
S = 4


def _draft(model, block_size=S, seed=1, online="chained", **over) -> DraftMemory:
    torch.manual_seed(seed)
    cfg = DraftConfig(**{**dict(num_draft_layers=2, block_size=block_size, mask_token_id=None, num_anchors=8,
                                markov_rank=8, kind="draft_memory", memory=MemoryConfig(online=online)), **over})
    d = build_draft(cfg, model.config, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                    aux_layer_ids=AUX)
    with torch.no_grad():  # a non-trivial gamma, so a missing memory norm shows up
        d.memory_norm.weight.add_(0.3 * torch.randn_like(d.memory_norm.weight))
    return d.eval()


_ITEMS: dict = {}


def _batch(model, n=3, anchors=8, seed=0, response=19):
    key = (model.config.model_type, model.config.vocab_size, n, seed, response)
    if key not in _ITEMS:
        items = items_from_target(model, AUX, n, 5, response, seed=seed,
                                  token_range=min(256, model.config.vocab_size))
        items[1] = {k: v[:-4] for k, v in items[1].items()}  # ragged
        _ITEMS[key] = items
    return add_anchor_fields(CacheCollator(0)(_ITEMS[key]), anchors, S, torch.Generator().manual_seed(seed))


# -- stage 1 and the transition by hand ----------------------------------------------------------------------
def test_seed_c_to_f_example_by_hand():
    """Seed: old anchor C, context through B, reference D E F G H; D, E match, the third prediction is X: new anchor
    F, context through E, h_1..h_3 dropped, h_4, h_5 kept at G, H, the new block predicts G H I J K (B = 5).
    Also: an all-matched block moves to the bonus position with empty memory; a transition past the end is dropped."""
    target = tiny_model("qwen3")
    draft = _draft(target, block_size=5)
    ids = torch.arange(10, 26).view(1, 16)  # A=10 B=11 C=12 D=13 E=14 F=15 G=16 H=17 ... positions 0..15
    loss_mask = torch.ones(1, 16, dtype=torch.bool)
    loss_mask[0, :2] = False  # A, B: the prompt
    anchors, valid = torch.tensor([[2, 4, 12, 0]]), torch.tensor([[True, True, True, False]])
    batch = {"input_ids": ids, "loss_mask": loss_mask, "anchors": anchors, "anchor_valid": valid,
             "aux_hidden": torch.randn(1, 16, len(AUX), 64), "last_hidden": torch.randn(1, 16, 64)}
    batch.update(block_targets(ids, loss_mask, anchors, valid, 5))
    assert batch["targets"][0, 0].tolist() == [13, 14, 15, 16, 17]  # D E F G H
    assert batch["slot_valid"][0, 2].tolist() == [True, True, True, False, False]  # 13, 14, 15 | end
    pred = batch["targets"].clone()
    pred[0, 0, 2] = 99  # X instead of F; G, H after it match but do not count
    draft.greedy_tokens = lambda h, prev, sv: torch.where(sv, pred, torch.full_like(pred, -1))
    m = first_mismatch(draft.greedy_tokens(None, None, batch["slot_valid"]), batch["targets"], batch["slot_valid"])
    assert m.tolist() == [[2, 5, 3, 0]]
    with torch.no_grad():
        h_old = draft.forward_train(ids, batch["aux_hidden"], anchors, valid)  # [1, 4, 5, H]
    out = draft.prepare_batch(batch)
    assert out["anchors"].tolist() == [[5, 10, 0, 0]]  # F; C+5+1 = bonus position K; dropped ones last
    assert out["anchor_valid"].tolist() == [[True, True, False, False]]
    assert out["stage1_anchors"].tolist() == [[2, 4, 12, 0]] and out["stage1_matches"].tolist() == [[2, 5, 3, -1]]
    assert out["targets"][0, 0].tolist() == [16, 17, 18, 19, 20]  # G H I J K
    assert out["prev_tokens"][0, 0].tolist() == [15, 16, 17, 18, 19]  # F G H I J
    assert out["slot_valid"][0, 0].all() and out["slot_valid"][0, 1].sum() == 5 and not out["slot_valid"][0, 2:].any()
    assert out["slot_index"].shape == (3, 10)
    # memory of old slots 1..4 (h_2..h_5): only h_4, h_5 kept, at the predicted positions of G, H
    assert out["memory_valid"][0, 0].tolist() == [False, False, True, True]
    assert out["memory_positions"][0, 0].tolist() == [4, 5, 6, 7] and ids[0, 6:8].tolist() == [16, 17]
    torch.testing.assert_close(out["memory_hidden"][0, 0, 2:], h_old[0, 0, 3:5], rtol=0, atol=1e-6)
    assert not out["memory_valid"][0, 1:].any()  # bonus: empty memory; dropped / invalid: none
    extra = draft.extra_kv(out, out["anchors"], out["anchor_valid"])
    assert extra.states.shape == (1, 4 * 4, 64)
    own0 = extra.owner[0] == 0
    assert extra.positions[0, own0].tolist() == [6, 7] and not (extra.owner[0] >= 1).any()
    with torch.no_grad():
        torch.testing.assert_close(extra.states[0, own0], draft.memory_norm(draft.memory_proj(h_old[0, 0, 3:5])))


def test_transitions_without_supervision_are_dropped():
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)  # two responses, one gap
    anchors = torch.tensor([[1, 1, 1, 2, 7, 7]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    m = torch.tensor([[0, 2, 3, 0, 1, 2]])
    new, kept = transition(anchors, valid, m, loss_mask)
    # 1+0+1 = 2 ok; 1+2+1 = 4: last response token, nothing to predict -> dropped; 5: not a response token;
    # 3 ok; 9: last position -> dropped; 10: past the sequence -> dropped
    assert kept.tolist() == [[True, False, False, True, False, False]]
    assert new.tolist() == [[2, 0, 0, 3, 0, 0]]
    pos, mem = memory_slots(anchors, m, kept, torch.ones(1, 6, 4, dtype=torch.bool))
    assert mem[0, 0].tolist() == [True, True, True] and pos[0, 0].tolist() == [3, 4, 5]
    assert mem[0, 3].tolist() == [True, True, True] and not mem[0, [1, 2, 4, 5]].any()


# -- stage 1 == a step-by-step greedy loop ------------------------------------------------------------------------
def _successor_draft(draft):
    """A Markov head that strongly predicts ``prev + 1 (mod V)``, so greedy drafts follow a known rule."""
    v = draft.vocab_size
    with torch.no_grad():
        draft.markov.w1.weight.zero_()
        draft.markov.w1.weight[:, :v].copy_(torch.eye(v))
        draft.markov.w2.weight.zero_()
        draft.markov.w2.weight[:, :v].copy_(100.0 * torch.eye(v).roll(1, dims=0))
    return draft


def _rule_batch(target, seed=0):
    """Responses following ``x + 1 (mod 16)`` with random breaks: runs of every length against the rule."""
    items = [dict(it) for it in items_from_target(target, AUX, 4, 5, 23, seed=seed, token_range=16)]
    g = torch.Generator().manual_seed(seed)
    for it in items:
        ids = it["input_ids"].clone()
        for t in range(5, ids.shape[0]):
            brk = torch.rand((), generator=g) < 0.3
            ids[t] = torch.randint(0, 16, (), generator=g) if brk else (ids[t - 1] + 1) % 16
        it["input_ids"] = ids
    return add_anchor_fields(CacheCollator(0)(items), 16, S, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rule", [False, True])
def test_stage1_equals_step_by_step_greedy_generation(rule, one_thread):
    """Teacher-forced argmax up to the first error == greedy generation slot by slot (propose with the chosen
    predecessors) compared with the reference. A 16-token vocabulary; with ``rule`` a successor Markov head and
    rule-following references give matches of every length 0..S."""
    target = tiny_model("qwen3", vocab_size=16, eos_token_id=None, pad_token_id=None)
    draft = _draft(target, markov_rank=16)
    if rule:
        draft, batch = _successor_draft(draft), _rule_batch(target)
    else:
        batch = _batch(target, n=4, anchors=16, response=23)
    out = draft.prepare_batch(batch)
    greedy = lambda logits: (logits.argmax(-1), torch.softmax(logits, -1))  # noqa: E731
    seen = []
    for b, a in batch["anchor_valid"].nonzero().tolist():
        p = int(batch["anchors"][b, a])
        cache = draft.new_context_cache(batch=1, max_len=64)
        draft.extend_context(cache, batch["aux_hidden"][b:b + 1, :p])
        toks = draft.propose(cache, batch["input_ids"][b, p].view(1), greedy).tokens[0]
        m = 0
        while m < S and batch["slot_valid"][b, a, m] and toks[m] == batch["targets"][b, a, m]:
            m += 1
        assert ((out["stage1_anchors"][b] == p) & (out["stage1_matches"][b] == m)).any(), (b, p, m)
        seen.append(m)
    assert len(seen) > 40 and len(set(seen)) >= (S + 1 if rule else 2), sorted(seen)
    n_valid = int(batch["anchor_valid"].sum())
    assert int(out["stage1_kept"].sum()) == int(out["anchor_valid"].sum()) < n_valid  # some dropped at the end


# -- training forward with memory == single-block inference ---------------------------------------------------------
def _block_memory(batch, b, a):
    v = batch["memory_valid"][b, a]
    return {k: batch[k][b:b + 1, a:a + 1, v] for k in MEMORY_KEYS}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_forward_with_memory_equals_single_block_inference(family, one_thread):
    target = tiny_model(family)
    draft = _draft(target)
    batch = draft.prepare_batch(_batch(target))
    no_memory = {k: v for k, v in batch.items() if k not in MEMORY_KEYS}
    with torch.no_grad():
        h = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                extras=batch)
        h0 = draft.forward_train(batch["input_ids"], batch["aux_hidden"], batch["anchors"], batch["anchor_valid"],
                                 extras=no_memory)
    with_memory = 0
    for b, a in batch["anchor_valid"].nonzero().tolist():
        p = int(batch["anchors"][b, a])
        cache = draft.new_context_cache(batch=1, max_len=64)
        draft.extend_context(cache, batch["aux_hidden"][b:b + 1, :p])
        mem = _block_memory(batch, b, a)
        h_inf = draft.forward_block(cache, batch["input_ids"][b, p].view(1), mem)[0]
        torch.testing.assert_close(h_inf, h[b, a], rtol=0, atol=1e-5)
        if mem["memory_hidden"].shape[2]:
            with_memory += 1
            assert (h[b, a] - h0[b, a]).abs().max() > 1e-3  # the memory is read
        else:
            torch.testing.assert_close(h[b, a], h0[b, a], rtol=0, atol=1e-5)
    assert with_memory >= 6


def test_gradients_only_through_stage_two(one_thread):
    from dspark_core.draft.task import DSparkTask

    target = tiny_model("qwen3")
    items = items_from_target(target, AUX, 4, 5, 19, seed=3)
    cfg = DraftConfig(num_draft_layers=1, block_size=S, mask_token_id=259, num_anchors=8, markov_rank=8,
                      kind="draft_memory")
    task = DSparkTask(cfg, LossConfig(), target_config=target.config,
                      embed_weight=target.get_input_embeddings().weight.detach(),
                      lm_head_weight=target.get_output_embeddings().weight.detach(), aux_layer_ids=AUX,
                      train_data=items, pad_id=0)
    model = task.build_model(torch.device("cpu"), torch.float32)
    raw = task.collate(items, torch.Generator().manual_seed(0))
    with torch.no_grad():
        (batch,) = task.prepare_step(model, [raw])
    assert not batch["memory_hidden"].requires_grad and batch["memory_valid"].any()
    assert batch["prev_tokens"] is not raw["prev_tokens"] and not torch.equal(batch["anchors"], raw["anchors"])
    sums = task.forward_sums(model, batch)
    dens = task.denominators(batch)
    (sums["distill"] / dens["weight"]).backward()
    g = model.draft.memory_proj.weight.grad
    assert g is not None and g.abs().sum() > 0 and model.draft.memory_norm.weight.grad.abs().sum() > 0
    assert task.prepare_step(model, [batch])[0] is batch  # prepared once


# -- eval_offline: the memory at its post-error anchors, beside the baseline on the same anchors ---------------------
def _tau_by_inference(draft, prep, b, a, memory=None):
    """tau_prob and a_0 of block (b, a) of a prepared batch through the inference path (full vocabulary)."""
    from dspark_core.metrics import overlap

    p = int(prep["anchors"][b, a])
    cache = draft.new_context_cache(batch=1, max_len=64)
    draft.extend_context(cache, prep["aux_hidden"][b:b + 1, :p])
    h = draft.forward_block(cache, prep["input_ids"][b, p].view(1), memory)[0]  # [S, H]
    tau, prod, first = 1.0, 1.0, None
    for j in range(S):
        if not prep["slot_valid"][b, a, j]:
            break
        m = draft.markov_features(prep["prev_tokens"][b, a, j], h[j], None)
        q = torch.softmax(draft.slot_logits(h[j]) + draft.markov_bias(m).float(), -1)
        aj = float(overlap(torch.softmax(draft.slot_logits(prep["last_hidden"][b, p + j]), -1), q))
        first = aj if first is None else first
        prod *= aj
        tau += prod
    return tau, first


def test_eval_offline_reports_the_reference_at_the_same_post_error_anchors(one_thread):
    """Plain keys: the memory draft without memory at the random anchors (= its weights as a baseline draft);
    post_error/...: with memory at stage 1's new anchors; post_error/baseline/...: the reference draft at exactly
    those anchors. Both post-error sets against a replay of the anchors through the inference path."""
    from dspark_core.draft.eval_offline import EvalOfflineConfig, evaluate_offline
    from dspark_core.draft.model import DSparkDraft

    target = tiny_model("qwen3")
    _batch(target)
    items = _ITEMS[(target.config.model_type, target.config.vocab_size, 3, 0, 19)]
    mem = _draft(target)
    torch.manual_seed(7)
    ref = build_draft(DraftConfig(**{**mem.cfg.to_dict(), "kind": "baseline"}), target.config,
                      target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                      aux_layer_ids=AUX).eval()
    ecfg = EvalOfflineConfig(batch_size=2, seed=3, num_anchors=6)
    res = evaluate_offline(mem, items, ecfg, reference=ref, progress=False)
    plain = [k for k in res if "/" not in k]
    assert sorted(k for k in res if k.startswith("post_error/baseline/")) == sorted(f"post_error/baseline/{k}"
                                                                                   for k in plain)
    assert sorted(k for k in res if k.startswith("post_error/") and k.count("/") == 1) == sorted(
        f"post_error/{k}" for k in plain)
    same_weights = DSparkDraft(mem.cfg, target.config, target.get_input_embeddings().weight,
                               target.get_output_embeddings().weight, aux_layer_ids=AUX)
    same_weights.load_state_dict(mem.state_dict(), strict=False)
    alone = evaluate_offline(same_weights, items, ecfg, progress=False)
    assert {k: res[k] for k in plain} == pytest.approx(alone, rel=1e-6)  # no memory at a random anchor
    gen = torch.Generator().manual_seed(ecfg.seed)
    sums = {"mem": [0.0, 0.0], "ref": [0.0, 0.0]}
    blocks = with_memory = 0
    with torch.no_grad():
        for start in range(0, len(items), ecfg.batch_size):
            batch = add_anchor_fields(CacheCollator(0)(items[start:start + 2]), 6, S, gen)
            prep = mem.prepare_batch(batch)
            for b, a in prep["anchor_valid"].nonzero().tolist():
                m = int(prep["stage1_matches"][b, a])
                assert int(prep["anchors"][b, a]) == int(prep["stage1_anchors"][b, a]) + m + 1  # after the error
                memory = _block_memory(prep, b, a)
                with_memory += int(memory["memory_hidden"].shape[2] > 0)
                for key, draft, extras in (("mem", mem, memory), ("ref", ref, None)):
                    tau, a0 = _tau_by_inference(draft, prep, b, a, extras)
                    sums[key][0] += tau
                    sums[key][1] += a0
                blocks += 1
    assert blocks >= 8 and with_memory >= 4
    assert res["post_error/num_blocks"] == res["post_error/baseline/num_blocks"] == blocks
    for key, prefix in (("mem", "post_error/"), ("ref", "post_error/baseline/")):
        assert res[prefix + "tau_prob"] == pytest.approx(sums[key][0] / blocks, rel=1e-5)
        assert res[prefix + "accept_rate@0"] == pytest.approx(sums[key][1] / blocks, rel=1e-5)
    assert res["post_error/tau_prob"] != pytest.approx(res["post_error/baseline/tau_prob"], rel=1e-3)
    ref.block_size = S + 1
    with pytest.raises(ValueError, match="eval_offline.reference baseline: block_size 5 differs"):
        evaluate_offline(mem, items, ecfg, reference=ref, progress=False)


# -- parameter counts ---------------------------------------------------------------------------------------------
def test_seed000_parameter_count():
    base, mem = seed000_param_counts("draft_memory")
    assert mem["variant"] == 2560 ** 2 + 2560 == 6_556_160
    assert mem["draft"] - base["draft"] == 6_556_160


def test_bad_memory_params_are_named():
    from dspark_core.config import ParamsError

    with pytest.raises(ParamsError, match="draft.memory.online must be one of"):
        DraftConfig.from_dict({"kind": "draft_memory", "memory": {"online": "both"}}, prefix="draft.")
    from dspark_core.draft.eval_offline import EvalOfflineConfig

    with pytest.raises(ParamsError, match="eval_offline.reference must name a variant .*; got 'a/b'"):
        EvalOfflineConfig.from_dict({"reference": "a/b"}, prefix="eval_offline.")
    target = tiny_model("qwen3")
    d = _draft(target)
    with pytest.raises(ValueError, match="online mode must be one of"):
        d.set_online_mode("x")
    from dspark_core.draft.inference import new_context_cache

    with pytest.raises(ValueError, match="MemoryCache"):
        d.propose(new_context_cache(d, 1, 16), torch.tensor([3]), lambda x: (x.argmax(-1), x))


# -- online: the reference engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("online", ["chained", "first_stage"])
def test_online_greedy_identical_to_ar_and_memory_is_the_kept_suffix(online, one_thread):
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.engine import SpeculativeDecoder
    from dspark_core.decoding.target_runner import TargetRunner

    model = tiny_model("qwen3", vocab_size=16, eos_token_id=None, pad_token_id=None)
    draft = _draft(model, online=online, num_draft_layers=1)
    runner = TargetRunner(model, max_len=96, aux_layer_ids=draft.aux_layer_ids)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ar = ARDecoder(runner).generate(prompt, 40)
    calls: list = []  # (cycle, memory or None, output) of every forward_block
    inner_fb, inner_propose = draft.forward_block, draft.propose

    def fb(cache, anchor, extras=None):
        out = inner_fb(cache, anchor, extras)
        mem = None if extras is None or "memory_hidden" not in extras else (
            extras["memory_hidden"].clone(), extras["memory_positions"].clone())
        calls.append((len(starts) - 1, mem, out.clone()))
        return out

    starts: list = []

    def spy(cache, anchor, sample_fn, threshold=0.0, extras=None):
        starts.append(cache.length)
        return inner_propose(cache, anchor, sample_fn, threshold, extras)

    draft.forward_block, draft.propose = fb, spy
    cycles = []
    res = SpeculativeDecoder(runner, draft, block_size=S, on_cycle=cycles.append).generate(prompt, 40)
    assert res.tokens == ar.tokens
    assert 1.0 < res.mean_accepted_length < S + 1
    assert any(c.num_accepted < c.num_proposed for c in cycles) and any(c.num_accepted > 0 for c in cycles)
    fed = 0
    for k in range(1, len(cycles)):
        prev, mine = cycles[k - 1], [c for c in calls if c[0] == k]
        prev_calls = [c for c in calls if c[0] == k - 1]
        assert prev.anchor_position == starts[k - 1] and cycles[k].anchor_position == starts[k]
        # chained: the proposal's own states; first_stage: the last (memory-free) forward of the cycle
        source = prev_calls[0][2] if online == "chained" else prev_calls[-1][2]
        if online == "first_stage":
            assert prev_calls[-1][1] is None
        a = prev.num_accepted
        if a + 1 >= S:
            assert mine[0][1] is None  # everything accepted (or only the bonus left): no memory
            continue
        mem, pos = mine[0][1]
        torch.testing.assert_close(mem[0, 0], source[0, a + 1:], rtol=0, atol=0)
        assert pos[0, 0].tolist() == [prev.anchor_position + i for i in range(a + 2, S + 1)]
        assert pos[0, 0, 0] == cycles[k].anchor_position + 1  # aligned with the new block's first prediction
        fed += 1
    assert fed >= 3
    assert len(calls) == len(cycles) + (fed if online == "first_stage" else 0)


def test_bench_online_reports_both_memory_sources(tmp_path, monkeypatch, one_thread):
    """bench_online@draft_memory: the reference engine (the static one refuses the extra_kv hook, and says so),
    greedy output identical to AR, and the MAL of chained and first-stage memory side by side."""
    import json

    import yaml

    from _decoding_utils import fit_draft_to_target
    from dspark_core.bench.online import BenchOnlineConfig, decode_dataset, run_bench_online_stage, stop_ids_of
    from dspark_core.checkpoint import save_draft
    from dspark_core.decoding.ar import ARDecoder
    from dspark_core.decoding.target_runner import TargetRunner
    from dspark_core.target import load_target
    from dspark_core.testing import save_tiny_target

    model, tok = load_target(save_tiny_target(tmp_path / "data" / "target", "qwen3"))
    conversations = [["What is 2 + 3?"], ["Name a colour."]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in conversations))
    section = dict(datasets=["jsonl:p.jsonl"], max_prompts=2, max_new_tokens=12, max_len=256, peers=[],
                   out_dir="reports/bo")
    draft = _draft(model, num_draft_layers=1)
    # fitted a few steps to the target's own answers: partly right, so "identical" covers accepted and rejected
    ar = ARDecoder(TargetRunner(model, max_len=256, aux_layer_ids=draft.aux_layer_ids))
    run = decode_dataset(conversations, tok, ar, ar, BenchOnlineConfig.from_dict(section), stop_ids_of(model, tok))
    fit_draft_to_target(draft, model, run.prompts, [r.tokens for r in run.ar], steps=20)
    save_draft(tmp_path / "data" / "train" / "draft_memory" / "final", draft)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"bench_online": section}))
    monkeypatch.chdir(tmp_path)
    metrics = run_bench_online_stage("params.yaml", "draft_memory")
    setup = metrics["setup"]
    assert setup["engine"] == "reference" and setup["draft_kind"] == "draft_memory"
    assert "overrides the variant hook extra_kv" in setup["static_engine_problem"]
    for name in ("jsonl:p.jsonl", "overall"):
        rows = metrics[name]["online_modes"]
        assert set(rows) == {"chained", "first_stage"} and rows["chained"]["mal"] == metrics[name]["mal"]
        assert all(r["identical"] and 1.0 < r["mal"] < S + 1 for r in rows.values()), rows
    saved = json.loads((tmp_path / "reports/bo/draft_memory.json").read_text())
    assert saved["overall"]["online_modes"]["first_stage"]["mal"] == rows["first_stage"]["mal"]
