"""Cached DMTD decode on the Triton decode kernels (``DMTDDecoder(kernels=True)``): for each variant, logits against
the torch cached decoder and the teacher-forced training forward (prompts on and off cycle boundaries, a refresh
prompt shorter than tau), the same greedy tokens, the timed pieces, and the refusals.

CPU: the kernels run under Triton's interpreter (tiny model, few tokens); on a GPU they run for real."""

from __future__ import annotations

import os

import pytest
import torch

from _decoding_utils import one_thread, untuned_kernels  # noqa: F401 (fixtures)
from dspark_core.dmtd.config import VARIANTS

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from dspark_core.kernels import triton_ok  # noqa: E402
from dspark_core.dmtd.inference import DMTDDecoder  # noqa: E402
from dspark_core.dmtd.model import DMTDModel  # noqa: E402
from dspark_core.testing import tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.usefixtures("one_thread", "untuned_kernels"),
              pytest.mark.skipif(not triton_ok(DEVICE), reason="needs Triton on CUDA or TRITON_INTERPRET=1")]
TAU, P, MASK = 4, 1, 259
ATOL = 2e-5  # fp32: the kernels sum in another order than torch


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen3", num_hidden_layers=2).to(DEVICE)  # one parallel layer, one sequential


def dmtd(lm, variant) -> DMTDModel:
    return DMTDModel(lm, P, TAU, MASK, variant, attn_backend="dense").eval()


def seq(n, seed=3):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_logits_equal_torch_and_teacher_forced(lm, variant):
    m = dmtd(lm, variant)
    x = seq(9)
    with torch.no_grad():
        ref = m.logits(x).float()
    fast, slow = DMTDDecoder(m, 12, kernels=True), DMTDDecoder(m, 12, kernels=False)
    assert fast.kernels and not slow.kernels
    # shorter than tau (refresh: the prompt's only cycle is the first), on a cycle boundary, past the first cycle;
    # each continuation crosses one cycle head (one P step) -- the interpreter is slow
    for n, k in ((3, 2), (4, 1), (6, 3)):
        got = fast.score(x[:, :n], x[:, n: n + k])
        torch.testing.assert_close(got, slow.score(x[:, :n], x[:, n: n + k]), atol=ATOL, rtol=0, msg=f"prompt {n}")
        torch.testing.assert_close(got, ref[:, : n + k], atol=ATOL, rtol=0, msg=f"prompt {n}")


@pytest.mark.parametrize("variant", ["causal_refresh", "bidir_norefresh"])
def test_kernel_greedy_tokens_equal_torch(lm, variant):
    m = dmtd(lm, variant)
    prompt = seq(3, seed=4)
    fast = DMTDDecoder(m, 12, kernels=True).generate(prompt, 6).tokens
    assert fast == DMTDDecoder(m, 12, kernels=False).generate(prompt, 6).tokens


def test_kernel_cycle_layout_maps_the_block_mask(lm):
    """Refresh at head 8 (max_len 12): real rows causal in place; shadow rows rotated at 8..11, written to the
    scratch slots 12..15 and reading logical keys >= 8 there; bidirectional rows see up to the block's end."""
    for variant, seen in (("causal_refresh", [8, 9, 10, 11]), ("bidir_refresh", [11] * 4)):
        dec = DMTDDecoder(dmtd(lm, variant), 12, kernels=True)
        dec._pos.fill_(8)
        q_pos, attn_pos, (offset, back) = dec.kernel_cycle_layout()
        assert q_pos.tolist() == list(range(4, 12)) and attn_pos.tolist() == [4, 5, 6, 7, *seen]
        assert offset.tolist() == [0] * 4 + [4] * 4 and back.tolist() == [0] * 4 + [s - 8 for s in seen]
    dec = DMTDDecoder(dmtd(lm, "bidir_norefresh"), 12, kernels=True)
    dec._pos.fill_(8)
    q_pos, attn_pos, tree = dec.kernel_cycle_layout()
    assert q_pos.tolist() == [8, 9, 10, 11] and attn_pos.tolist() == [11] * 4 and tree is None


def test_pieces_run_the_decode_steps(lm):
    dec = DMTDDecoder(dmtd(lm, "bidir_refresh"), 12, kernels=True)
    # built first, at the decoder's capture position (head tau): on a GPU, capturing runs each piece, and the
    # slots it writes there are rewritten by the prefill below before anything reads them
    pieces = dec.pieces()
    x = seq(8)
    want = dec.score(x[:, :7], x[:, 7:])[:, 7]  # logits after position 7: the S step of token 7
    dec.prefill(x[:, :7])  # shadow of the cycle 4..7, S cache 0..6
    dec._start_cycle(4)  # the production P step on the same cycle (prompt tokens 4..6 in the block are MASK)
    shadow = dec.shadow.clone()
    dec.shadow.zero_()
    pieces["p_step"]()
    torch.testing.assert_close(dec.shadow, shadow, atol=0, rtol=0)
    dec._s_input(7)
    pieces["s_step"]()
    torch.testing.assert_close(pieces["lm_head"](), want, atol=ATOL, rtol=0)


def test_kernels_refused_with_the_reason(lm):
    m = dmtd(lm, "causal_refresh")
    with pytest.raises(ValueError, match="batch_size is 2"):
        DMTDDecoder(m, 12, batch_size=2, kernels=True)
    with pytest.raises(ValueError, match="kernels must be"):
        DMTDDecoder(m, 12, kernels="yes")
    with pytest.raises(ValueError, match="kernel_gemm"):
        DMTDDecoder(m, 12, kernels=True, kernel_gemm=("fma", "tf32"))
    assert not DMTDDecoder(m, 12, batch_size=2).kernels  # auto: the torch path where the kernels do not apply
