"""DMTD data, task and evaluation: packing, labels, a short run of the shared trainer, checkpoint reload,
perplexity against HF, answer extraction, GSM8K accuracy, ``evaluate_variant`` end to end."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from dspark_core.dmtd.config import DMTDConfig, DMTDEvalConfig
from dspark_core.dmtd.data import Document, document_labels, load_packed, pack_documents
from dspark_core.dmtd.evaluate import evaluate_variant, extract_answer, gold_answer, gsm8k_accuracy, perplexity
from dspark_core.dmtd.inference import GenerationResult
from dspark_core.dmtd.model import IGNORE, PlainModel, load_dmtd, resolve_checkpoint
from dspark_core.dmtd.task import DMTDTask
from dspark_core.errors import UserError
from dspark_core.testing import save_tiny_target, tiny_model, tiny_tokenizer

MASK = 259


pytestmark = pytest.mark.usefixtures("one_thread")


def write_regen(path, n: int, seed: int) -> None:
    """Prompts of random bytes; responses count upward from the prompt's last byte (learnable)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "source": [], "prompt_ids": [], "response_ids": []}
    for i in range(n):
        p = torch.randint(0, 256, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        r = [(p[-1] + j + 1) % 256 for j in range(int(torch.randint(5, 20, (1,), generator=g)))]
        rows["id"].append(f"s{seed}-{i}")
        rows["source"].append("test")
        rows["prompt_ids"].append(p)
        rows["response_ids"].append(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dmtd")
    save_tiny_target(root / "target", "llama")
    write_regen(root / "regen" / "train.parquet", 24, seed=0)
    write_regen(root / "regen" / "eval.parquet", 6, seed=1)
    return root


def cfg_for(root, **kw) -> DMTDConfig:
    base = dict(num_parallel_layers=4, tau=4, mask_token_id=MASK, max_length=48, target_dir=str(root / "target"),
                regen_dir=str(root / "regen"),
                eval=DMTDEvalConfig(max_new_tokens=6, speed_prompts=1, speed_new_tokens=8, batch_size=2))
    base.update(kw)
    return DMTDConfig(**base)


# -- packing ------------------------------------------------------------------------------------------
def test_labels_follow_supervision():
    d = Document(ids=torch.tensor([5, 6, 7, 8, 9]).numpy(), supervised=torch.tensor([0, 0, 1, 1, 1]).bool().numpy())
    assert document_labels(d).tolist() == [IGNORE, 7, 8, 9, IGNORE]


def test_packing_keeps_documents_whole_and_positions_per_document():
    import numpy as np

    docs = [Document(np.arange(n) + 10 * n, np.ones(n, bool)) for n in (9, 5, 7, 3, 2, 1)]
    rows, stats = pack_documents(docs, 12, pad_id=MASK)
    assert stats.dropped_unsupervised == 1  # the 1-token document has no target
    seen = []
    for r in rows:
        assert all(r[k].shape == (12,) for k in r)
        for d in r["doc_ids"].unique().tolist():
            sel = r["doc_ids"] == d
            assert r["position_ids"][sel].tolist() == list(range(int(sel.sum())))
            seen.append(r["input_ids"][sel].tolist())
    for d in docs[:-1]:
        assert d.ids.tolist() in seen
    assert stats.supervised_tokens == sum(n - 1 for n in (9, 5, 7, 3, 2))


def test_load_packed_response_and_all(workspace):
    resp, s1 = load_packed(workspace / "regen" / "train.parquet", 48, "response", MASK)
    every, s2 = load_packed(workspace / "regen" / "train.parquet", 48, "all", MASK)
    assert s2.supervised_tokens > s1.supervised_tokens > 0
    r = resp[0]
    sup = r["labels"] != IGNORE
    nxt = torch.cat([r["input_ids"][1:], torch.tensor([-1])])
    assert torch.equal(r["labels"][sup], nxt[sup])
    with pytest.raises(ValueError, match="not found"):
        load_packed(workspace / "regen" / "nope.parquet", 48, "response", MASK)


# -- training through the shared trainer ---------------------------------------------------------------
def test_short_training_lowers_loss_and_checkpoint_reloads(workspace, tmp_path):
    from dspark_core.train.trainer import TrainConfig, train

    cfg = cfg_for(workspace)
    task = DMTDTask(cfg, "bidir_refresh")
    tcfg = TrainConfig(lr=3e-3, warmup_ratio=0.0, total_steps=14, micro_batch_size=2, global_batch_size=4,
                       checkpoint_every=100, log_every=1, out_dir=str(tmp_path / "train"), seed=3)
    res = train(task, tcfg, progress=False)
    first, last = res.history[0], res.history[-1]
    assert last["ce"] < 0.7 * first["ce"]
    assert 0 <= last["token_acc"] <= 1 and last["token_acc"] > first["token_acc"]
    assert resolve_checkpoint(tmp_path / "train").name == "step_00000014"  # via checkpoints/latest.json
    reloaded = load_dmtd(cfg.target_dir, cfg, "bidir_refresh", tmp_path / "train")
    x = task.eval_dataset()[0]
    with torch.no_grad():
        a = res.model.eval().logits(x["input_ids"][None], x["position_ids"][None], x["doc_ids"][None])
        b = reloaded.logits(x["input_ids"][None], x["position_ids"][None], x["doc_ids"][None])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_dmtd_checkpoints_hold_no_pickle_and_resume_bit_identically(workspace, tmp_path, param_dtype):
    """DMTD fine-tunes checkpoint through the shared trainer's code: a step folder holds safetensors + JSON (no
    pickle), and a run resumed from step 2 ends with the uninterrupted run's weights; with bf16 working weights the
    float32 masters travel in the checkpoint too."""
    from dspark_core.train.trainer import TrainConfig, train

    def run(out, max_steps):
        tcfg = TrainConfig(lr=3e-3, warmup_ratio=0.0, total_steps=5, max_steps=max_steps, micro_batch_size=2,
                           global_batch_size=2, checkpoint_every=2, log_every=1, out_dir=str(out), seed=3,
                           param_dtype=param_dtype)
        return train(DMTDTask(cfg_for(workspace), "causal_norefresh"), tcfg, progress=False)

    full = run(tmp_path / "full", 4)
    run(tmp_path / "part", 2)
    resumed = run(tmp_path / "part", 4)
    step = tmp_path / "part" / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "model.safetensors", "state.json",
                                                      "state.safetensors"]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history[2:]]
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert (step / "state.safetensors").read_bytes() == (tmp_path / "full" / "checkpoints" / "step_00000004" /
                                                         "state.safetensors").read_bytes()


def test_nested_eval_section_and_bad_values():
    cfg = DMTDConfig.from_dict({"tau": 3, "eval": {"max_new_tokens": 5, "graph": "compile"}}, prefix="dmtd.")
    assert cfg.eval.max_new_tokens == 5 and cfg.tau == 3 and cfg.eval.batch_size == 4
    with pytest.raises(ValueError, match="dmtd.eval.graph"):
        DMTDConfig.from_dict({"eval": {"graph": "fast"}}, prefix="dmtd.")
    with pytest.raises(ValueError, match="dmtd.loss_on"):
        DMTDConfig.from_dict({"loss_on": "prompt"}, prefix="dmtd.")
    with pytest.raises(UserError, match=r"/nonexistent/run: no trained DMTD checkpoint .*dvc repro dmtd_train"):
        resolve_checkpoint("/nonexistent/run")
    with pytest.raises(UserError, match=r"dmtd.eval.speed_new_tokens must be >= 2"):
        DMTDConfig.from_dict({"eval": {"speed_new_tokens": 1}}, prefix="dmtd.")


def test_settings_that_cannot_run_here_are_named(workspace):
    """flex attention cannot train on a CPU; cuda_graph decoding needs a GPU; a max_length of one token (each
    document an answer's last token, no next token to learn) leaves nothing to train on: each is one error naming
    the param."""
    from dspark_core.dmtd.inference import resolve_graph_mode

    cfg = cfg_for(workspace)
    with pytest.raises(UserError, match=r"dmtd.attn_backend: flex trains on CUDA only"):
        DMTDTask(cfg.replace(attn_backend="flex"), "bidir_refresh").build_model(torch.device("cpu"), torch.float32)
    with pytest.raises(UserError, match=r"dmtd.eval.graph: 'cuda_graph' needs a CUDA device"):
        resolve_graph_mode("cuda_graph", torch.device("cpu"))
    with pytest.raises(UserError, match=r"train.parquet: no document keeps a supervised token within "
                                        r"dmtd.max_length=1 .*raise max_length"):
        load_packed(workspace / "regen" / "train.parquet", 1, "response", MASK)


def test_freeze_embeddings_and_denominators(workspace):
    task = DMTDTask(cfg_for(workspace, freeze_embeddings=True), "causal_norefresh")
    model = task.build_model(torch.device("cpu"), torch.float32)
    assert not model.lm.model.embed_tokens.weight.requires_grad
    assert model.lm.lm_head.weight.requires_grad  # untied in the tiny llama
    batch = task.collate(task.train_dataset()[:2], None)
    assert int(task.denominators(batch)["tokens"]) == int((batch["labels"] != IGNORE).sum())
    sums = task.forward_sums(model, batch)
    assert set(sums) == set(task.terms) | set(task.metric_denominators)


# -- evaluation ---------------------------------------------------------------------------------------
def test_plain_perplexity_equals_hf_cross_entropy(workspace):
    task = DMTDTask(cfg_for(workspace), "causal_refresh")
    rows = task.eval_dataset()
    lm = tiny_model("llama")
    got = perplexity(PlainModel(lm), rows, batch_size=2)
    ce = n = 0.0
    with torch.no_grad():
        for r in rows:  # one document at a time through HF
            for d in r["doc_ids"].unique():
                sel = r["doc_ids"] == d
                logits = lm(r["input_ids"][sel][None]).logits[0]
                lab = r["labels"][sel]
                keep = lab != IGNORE
                ce += float(F.cross_entropy(logits[keep], lab[keep], reduction="sum"))
                n += int(keep.sum())
    assert got["tokens"] == n
    assert got["ppl"] == pytest.approx(math.exp(ce / n), rel=1e-5)


@pytest.mark.parametrize("text, want", [
    ("so the total is 18 eggs. \\boxed{18}", 18.0),
    ("\\boxed{\\frac{1}{2}} hmm, final \\boxed{1,250.50}", 1250.5),
    ("The answer is $-7.", -7.0),
    ("first 3 then 4 then 12.", 12.0),
    ("no digits here", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_gold_answer_formats():
    assert gold_answer("Janet sells 9 eggs...\n#### 18") == 18.0
    assert gold_answer(" 1,000 ") == 1000.0 and gold_answer(3) == 3.0
    with pytest.raises(ValueError, match="no number"):
        gold_answer("none")


class ScriptedDecoder:
    """Answers every prompt with a fixed text (byte tokens of the tiny tokenizer)."""

    max_len = 512

    def __init__(self, text: str):
        self.ids = tiny_tokenizer().encode(text)

    def generate(self, prompt, max_new_tokens, sampling=None, stop_token_ids=(), generator=None):
        return GenerationResult(tokens=[self.ids[:max_new_tokens]], num_new_tokens=len(self.ids), prefill_s=0.0,
                                decode_s=1.0)


def test_gsm8k_accuracy_counts_right_answers():
    tok = tiny_tokenizer()
    items = [{"question": "2+2?", "answer": "#### 42"}, {"prompt_ids": [1, 2, 3], "answer": 41}]
    res = gsm8k_accuracy(ScriptedDecoder("it is \\boxed{42}"), tok, items, max_new_tokens=64)
    assert (res["accuracy"], res["correct"], res["total"]) == (0.5, 1, 2)
    assert [r["correct"] for r in res["records"]] == [True, False]
    with pytest.raises(ValueError, match="answer"):
        gsm8k_accuracy(ScriptedDecoder("1"), tok, [{"question": "q"}], 8)


def test_evaluate_variant_end_to_end(workspace, tmp_path):
    from safetensors.torch import save_file

    from dspark_core.checkpoint import write_manifest

    cfg = cfg_for(workspace)
    model = DMTDTask(cfg, "causal_refresh").build_model(torch.device("cpu"), torch.float32)
    save_file({k: v.contiguous() for k, v in model.named_parameters()}, str(tmp_path / "model.safetensors"))
    write_manifest(tmp_path, ["model.safetensors"])  # as the trainer's checkpoints carry it
    items = [{"question": "What is 1+1?", "answer": "2"}, {"prompt_ids": [65, 66, 67], "answer": "7"}]
    out = evaluate_variant(cfg, "causal_refresh", tmp_path, items, progress=False)
    ppl = out["perplexity"]
    # untrained DMTD (fine-tuned from nothing) vs the target: both finite, different
    assert math.isfinite(ppl["dmtd"]["ppl"]) and math.isfinite(ppl["target"]["ppl"])
    assert ppl["dmtd"]["tokens"] == ppl["target"]["tokens"] and ppl["dmtd"]["ppl"] != ppl["target"]["ppl"]
    assert out["gsm8k"]["dmtd"]["total"] == 2 and out["gsm8k"]["target"]["total"] == 2
    assert out["speed"]["dmtd"]["new_tokens"] == 8 and out["speed"]["speedup"] > 0


def test_plain_token_acc_equals_hf_argmax_over_every_batch(workspace):
    """token_acc against HF's own argmax: every other supervised label is set to the model's prediction (labels do
    not change the logits), so the expected accuracy is known, over every batch of the eval rows."""
    rows = DMTDTask(cfg_for(workspace), "causal_refresh").eval_dataset()
    assert len(rows) > 1
    lm, edited, hits, n = tiny_model("llama"), [], [], 0
    with torch.no_grad():
        for r in rows:
            labels, row_hits = r["labels"].clone(), 0
            for d in r["doc_ids"].unique():
                sel = (r["doc_ids"] == d).nonzero().flatten()
                pred = lm(r["input_ids"][sel][None]).logits[0].argmax(-1)
                keep = (labels[sel] != IGNORE).nonzero().flatten()
                labels[sel[keep[::2]]] = pred[keep[::2]]
                row_hits += int((pred[keep] == labels[sel[keep]]).sum())
                n += len(keep)
            edited.append({**r, "labels": labels})
            hits.append(row_hits)
    got = perplexity(PlainModel(lm), edited, batch_size=1)
    assert got["tokens"] == n and all(h > 0 for h in hits)
    assert got["token_acc"] == pytest.approx(sum(hits) / n, rel=1e-6)


def test_extract_answer_takes_the_last_number_inside_the_box():
    assert extract_answer("so \\boxed{3 + 4 = 7}") == 7.0
    assert extract_answer("\\boxed{x = 12} then 5") == 12.0
