"""TargetRunner (static KV cache) against the HF model's own full-sequence forward (fp32 CPU)."""

from __future__ import annotations

import pytest
import torch

from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.testing import tiny_model

from _decoding_utils import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = (-1, 0, 2, 4)  # embedding output + three decoder layers (tiny models have 6 layers)
TOL = 1e-5


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    """max |got - ref| <= tol * max |ref|: a chunked forward rounds its matmuls differently from a
    full-sequence one (~1e-6 relative), while any real mistake is O(1)."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} x max |ref| {scale:.3g}"


def _hf_reference(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    aux = torch.stack([out.hidden_states[i + 1] for i in AUX], dim=2)  # [1, L, K, H]
    return out.logits, aux


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_matches_hf_after_prefill_forward_truncate(family):
    """A random schedule of prefill / multi-token forward / rollback; each output equals HF's forward
    on the sequence as it stands (positions written before a rollback are overwritten, never read)."""
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 256, (1, 64), generator=gen)
    ref_logits, ref_aux = _hf_reference(model, seq)
    runner = TargetRunner(model, max_len=80, aux_layer_ids=AUX)
    logits, aux = runner.prefill(seq[:, :9])
    assert_close(logits, ref_logits[:, :9])
    assert_close(aux, ref_aux[:, :9])
    for _ in range(12):
        start = runner.length
        n = int(torch.randint(1, 9, (1,), generator=gen))
        if start + n > seq.shape[1]:
            break
        # a 'proposal' with a wrong tail, then roll back before the wrong tokens, as verification does
        wrong = seq[:, start : start + n].clone()
        keep = int(torch.randint(1, n + 1, (1,), generator=gen))
        wrong[:, keep:] = (wrong[:, keep:] + 7) % 256
        logits, aux = runner.forward(wrong)
        assert_close(logits[:, :keep], ref_logits[:, start : start + keep])
        assert_close(aux[:, :keep], ref_aux[:, start : start + keep])
        assert runner.length == start + n
        runner.truncate(start + keep)
    # after all the rollbacks one more chunk still sees exactly the right prefix
    start = runner.length
    logits, aux = runner.forward(seq[:, start : start + 5])
    assert_close(logits, ref_logits[:, start : start + 5])
    assert_close(aux, ref_aux[:, start : start + 5])


def test_prefill_variants_and_chunking():
    model = tiny_model("llama", num_hidden_layers=3)
    seq = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(seq, output_hidden_states=True)
    runner = TargetRunner(model, max_len=32, aux_layer_ids=(1, -1))
    logits, aux = runner.prefill(seq, last_logits_only=True, chunk_tokens=8)
    assert logits.shape == (1, 1, model.config.vocab_size) and runner.length == 21
    assert_close(logits[:, 0], out.logits[:, -1])
    assert_close(aux, torch.stack([out.hidden_states[2], out.hidden_states[0]], dim=2))
    # a second prefill starts from an empty cache
    logits, _ = runner.prefill(seq[:, :4])
    assert_close(logits, out.logits[:, :4])
    no_aux = TargetRunner(model, max_len=32)
    assert no_aux.prefill(seq)[1].shape == (1, 21, 0, model.config.hidden_size)


def test_step_move_kv_commit_match_forward():
    """The engines' device-side API: ``step`` at device positions leaves the host length alone and returns what
    ``forward`` returns; ``move_kv`` copies cache slots (every layer, K and V); ``commit`` sets the length."""
    model = tiny_model("qwen3", num_hidden_layers=2)
    seq = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    ref = TargetRunner(model, max_len=16, aux_layer_ids=(0,))
    ref.prefill(seq[:, :8])
    ref_logits, ref_aux = ref.forward(seq[:, 8:])
    runner = TargetRunner(model, max_len=16, aux_layer_ids=(0,))
    runner.prefill(seq[:, :8])
    logits, aux = runner.step(seq[:, 8:], torch.arange(8, 12))
    assert runner.length == 8
    assert torch.equal(logits, ref_logits) and torch.equal(aux, ref_aux)
    runner.commit(12)
    assert runner.length == 12
    k_before, v_before = (c.clone() for c in runner.caches)
    runner.move_kv(torch.tensor([10, 11]), torch.tensor([11, 3]))  # slot 11 is read before it is written
    k, v = runner.caches
    for got, old in ((k, k_before), (v, v_before)):
        assert torch.equal(got[:, :, :, 11], old[:, :, :, 10]) and torch.equal(got[:, :, :, 3], old[:, :, :, 11])
        assert torch.equal(got[:, :, :, :3], old[:, :, :, :3])
    with pytest.raises(ValueError, match="commit length"):
        runner.commit(17)


def test_bf16_close_to_hf_bf16():
    model = tiny_model("qwen3").to(torch.bfloat16)
    seq = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(seq).logits.float()
    runner = TargetRunner(model, max_len=16)
    logits, _ = runner.prefill(seq[:, :10])
    logits2, _ = runner.forward(seq[:, 10:])
    got = torch.cat([logits, logits2], dim=1).float()
    assert runner.k_cache.dtype == torch.bfloat16
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_errors():
    model = tiny_model("qwen3", num_hidden_layers=2)
    with pytest.raises(ValueError, match="final layer"):
        TargetRunner(model, max_len=8, aux_layer_ids=(1,))
    with pytest.raises(ValueError, match="duplicates"):
        TargetRunner(model, max_len=8, aux_layer_ids=(0, 0))
    with pytest.raises(ValueError, match="cuda_graph"):
        TargetRunner(model, max_len=8, cuda_graph=True)
    runner = TargetRunner(model, max_len=8, aux_layer_ids=(-1, 0))
    runner.prefill(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len=8"):
        runner.forward(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="truncate"):
        runner.truncate(7)
    with pytest.raises(ValueError, match="shape"):
        runner.forward(torch.zeros(2, 1, dtype=torch.long))
    sliding = tiny_model("qwen2", num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding"):
        TargetRunner(sliding, max_len=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile_", [False, True])
def test_cuda_graph_matches_eager(compile_):
    """CUDA graph replays (n = 1 decode, fixed-n verify) give the eager outputs, across rollbacks."""
    model = tiny_model("qwen3").cuda()
    seq = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(4)).cuda()
    eager = TargetRunner(model, max_len=64, aux_layer_ids=AUX)
    graphed = TargetRunner(model, max_len=64, aux_layer_ids=AUX, cuda_graph=True, compile=compile_)
    for r in (eager, graphed):
        r.prefill(seq[:, :10])
    for start, n, keep in [(10, 1, 1), (11, 5, 2), (13, 5, 5), (18, 1, 1), (19, 5, 1), (20, 5, 3)]:
        outs = [r.forward(seq[:, start : start + n]) for r in (eager, graphed)]
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)
        for r in (eager, graphed):
            r.truncate(start + keep)
    assert sorted(graphed._graphs) == [1, 5]
