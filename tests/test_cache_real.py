"""The `cache` stage on the real packaged SmolLM2 (slow): compression of real activations, fp8 error, teacher."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dspark_core.cache import CacheConfig, CacheDataset, build_store, verify_cache
from dspark_core.target import load_target, read_fingerprint

CHATS = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
     "clips did Natalia sell altogether in April and May?",
     "In April Natalia sold 48 clips. In May she sold half as many, which is 48 / 2 = 24 clips. Altogether she "
     "sold 48 + 24 = 72 clips in April and May. The answer is \\boxed{72}."),
    ("Write a short note to a friend about a trip to the mountains.",
     "Hi Sam! We just got back from three days in the mountains. The trail to the lake was steep but the view "
     "from the top was worth every step: snow on the peaks, pine trees everywhere and a sky so clear we could see "
     "the next valley. We camped by the water, cooked pasta on a tiny stove and watched the stars. Wish you had "
     "been there - next time you are coming with us!"),
    ("Explain what a hash table is in two sentences.",
     "A hash table stores key-value pairs in an array, using a hash function to turn each key into the index "
     "of the slot where its value lives. Lookups, inserts and deletes therefore take constant time on average, "
     "as long as collisions are handled, for example by chaining or open addressing."),
]


def write_chat_regen(path: Path, tok) -> Path:
    rows = []
    for i, (q, a) in enumerate(CHATS):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        rows.append({"id": f"chat{i}", "source": "test", "backend": "hf", "finish_reason": "stop",
                     "prompt_ids": tok(prompt, add_special_tokens=False)["input_ids"],
                     "response_ids": tok(a + "<|im_end|>", add_special_tokens=False)["input_ids"],
                     "prompt_text": prompt, "response_text": a})
    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                        ("response_ids", pa.list_(pa.int32())), ("prompt_text", pa.string()),
                        ("response_text", pa.string()), ("backend", pa.string()), ("finish_reason", pa.string())])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.mark.slow
def test_real_smollm2_cache(tmp_path, packaged_target):
    target = packaged_target
    model, tok = load_target(target)
    regen = write_chat_regen(tmp_path / "regen" / "train.parquet", tok)
    fp = read_fingerprint(target)["fingerprint"]
    stats = {}
    for aux_dtype in ("bf16", "fp8_e4m3"):
        cfg = CacheConfig(aux_layer_ids=(1, 8, 15, 22, 28), aux_dtype=aux_dtype, chunk_tokens=256, device="cpu")
        stats[aux_dtype] = build_store(model, fp, cfg, regen, tmp_path / f"{aux_dtype}.zarr")
    # real activations compress (measured 0.71x with these codec settings; entropy bound ~0.67x)
    assert 0.6 < stats["bf16"]["hidden_compression_ratio"] < 0.78, stats["bf16"]
    assert stats["fp8_e4m3"]["compression_ratio"] < 0.6, stats["fp8_e4m3"]  # measured: 0.48x of raw overall
    report = verify_cache(tmp_path / "bf16.zarr", target, n_samples=len(CHATS))
    assert report["exact"] and report["ok"]
    fp8 = verify_cache(tmp_path / "fp8_e4m3.zarr", target, n_samples=len(CHATS))
    assert fp8["exact"] and fp8["ok"] and fp8["max_aux_rel_err"] < 0.04 and fp8["max_last_rel_err"] < 4e-3
    # teacher logits = lm_head(stored last_hidden): the same top-1 as the model's own logits
    for item in CacheDataset(tmp_path / "fp8_e4m3.zarr", expected_fingerprint=fp):
        with torch.no_grad():
            want = model(item["input_ids"][None]).logits[0].argmax(-1)  # [L]
            got = model.lm_head(item["last_hidden"]).argmax(-1)  # [L]
        assert (got == want).float().mean() > 0.97
