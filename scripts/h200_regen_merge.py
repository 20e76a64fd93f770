"""Sampled second answers for the H200 run (scripts/h200_spec_run.sh, DSPARK_REGEN_SAMPLED=1), run in its work dir.

    python scripts/h200_regen_merge.py params   # params.yaml -> params_sampled.yaml: seed-004 sampling of the
                                                # train prompts on cuda:1 into data/regen_sampled
    python scripts/h200_regen_merge.py merge    # data/regen_all/{eval,train}.parquet = the greedy answers, plus
                                                # (train) the sampled ones with ids suffixed "~t07"

The cache stage then reads data/regen_all (the script sets cache.regen_dir): twice the training contexts
(greedy and T=0.7 answers of the same prompts) for the same regeneration wall time on two GPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 1}
SUFFIX = "~t07"


def write_sampled_params(src: Path = Path("params.yaml"), dst: Path = Path("params_sampled.yaml")) -> None:
    import yaml

    p = yaml.safe_load(src.read_text())
    device = "cuda:1" if str(p["regenerate"].get("device", "")).startswith("cuda") else p["regenerate"]["device"]
    p["regenerate"].update(SAMPLING, device=device, splits=["train"], out_dir="data/regen_sampled",
                           stats_path="reports/regenerate_sampled_stats.json")
    dst.write_text(yaml.safe_dump(p, sort_keys=False))


def merge(greedy_dir: Path = Path("data/regen"), sampled_dir: Path = Path("data/regen_sampled"),
          out: Path = Path("data/regen_all")) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for split in ("eval", "train"):
        table = pq.read_table(greedy_dir / f"{split}.parquet")
        extra = sampled_dir / f"{split}.parquet"
        if extra.is_file():
            t = pq.read_table(extra)
            ids = pc.binary_join_element_wise(t["id"], pa.scalar(SUFFIX), pa.scalar(""))
            t = t.set_column(t.schema.get_field_index("id"), "id", ids)
            table = pa.concat_tables([table, t.select(table.schema.names).cast(table.schema)])
        tmp = out / f"{split}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(out / f"{split}.parquet")
        print(f"{out / (split + '.parquet')}: {table.num_rows} answers")


if __name__ == "__main__":
    if sys.argv[1:] == ["params"]:
        write_sampled_params()
    elif sys.argv[1:] == ["merge"]:
        merge()
    else:
        sys.exit("usage: python scripts/h200_regen_merge.py params|merge")
