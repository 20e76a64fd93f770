"""Tile choice of ``fused_linear`` (``dspark_core.kernels.linear``): the candidate configurations, the timing
the tuner ranks them by (CUDA-graph replays over weight copies read from DRAM), and the tables that pin a
choice (a configuration file, or the per-device, per-target config store).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from dspark_core.errors import UserError

# (BLOCK_N, BLOCK_K, num_warps) candidates of the FMA GEMV; the first is the default before tuning
GEMV_CONFIGS = [(4, 512, 4), (2, 1024, 4), (1, 2048, 4), (1, 4096, 4), (2, 4096, 8), (2, 2048, 4), (4, 2048, 8),
                 (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8)]
# (BLOCK_N, BLOCK_K, SPLITS, num_warps[, num_stages[, swap]]) candidates of the tensor-core path (SPLITS > 1:
# split-K; num_stages: Triton's software pipeline depth, 3 when left out; swap 1: swap-AB, see _gemm_small).
# A step of n <= 16 tokens is memory-bound, so what decides its speed is the bytes each SM has in flight:
# tile x stages x programs per SM. The 5- and 6-tuples add deeper pipelines, wider tiles, swap-AB.
MMA_CONFIGS = [(32, 128, 1, 4), (16, 256, 1, 4), (64, 128, 1, 4), (16, 128, 2, 4), (16, 256, 2, 4),
                (32, 128, 2, 4), (16, 128, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4), (16, 64, 8, 4), (16, 128, 8, 4),
                (32, 64, 8, 4), (16, 512, 2, 8), (16, 1024, 1, 8),
                (32, 128, 1, 4, 5), (64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (32, 256, 1, 4, 4), (32, 256, 2, 4, 4),
                (16, 256, 2, 4, 5), (16, 256, 4, 4, 5), (16, 512, 1, 4, 4), (16, 512, 2, 4, 4), (32, 128, 2, 4, 6),
                (64, 64, 2, 4, 6), (128, 64, 1, 8, 4), (128, 128, 1, 8, 3), (64, 256, 1, 8, 3),
                # wider tiles (the 128 x 128 one won the largest GEMMs), and swap-AB (6th entry 1: the weight
                # tile as the MMA's M side, Hopper's warpgroup MMA)
                (128, 128, 1, 8, 4), (256, 64, 1, 8, 3), (64, 128, 1, 4, 4, 1), (128, 64, 1, 4, 4, 1),
                (128, 128, 1, 8, 3, 1), (128, 128, 1, 4, 4, 1), (64, 256, 1, 4, 3, 1), (64, 128, 2, 4, 4, 1),
                (128, 64, 2, 4, 5, 1), (256, 64, 1, 8, 3, 1),
                # swap-AB won Qwen3-4B's Q/K/V, O, gate/up and LM head on an H200; split-K with it for
                # the narrow matrices (N = 2560: O and down have 40 tiles of 64 for 132 SMs)
                (64, 128, 4, 4, 4, 1), (64, 128, 8, 4, 4, 1), (64, 256, 2, 4, 3, 1), (64, 256, 4, 4, 3, 1),
                (64, 64, 4, 4, 6, 1), (64, 64, 8, 4, 6, 1), (128, 128, 2, 8, 3, 1), (128, 64, 4, 4, 5, 1),
                # stream-K (SPLITS = -c: c programs per SM, ``_gemm_stream``), the 7 of 16 tried that placed in
                # the top 3 of some Qwen3-4B matrix on an H200 (bench_kernels tiles, one run): gate/up
                # 33.4 -> 29.6 us (its 76 column tiles of 128 leave 56 of 132 SMs idle), down 17.9 -> 17.2 us;
                # Q/K/V, O and the LM head keep plain tiles
                (64, 256, -1, 4, 3, 1), (128, 128, -1, 8, 3, 1), (64, 128, -2, 4, 4, 1), (64, 128, -1, 4, 4, 1),
                (128, 64, -1, 4, 5, 1), (64, 64, -2, 4, 6, 1), (128, 128, -2, 8, 3, 1)]
# FMA tiles of the mma mode, ("fma", BLOCK_N, BLOCK_K, num_warps) (``_gemv_rows``: one program takes every
# token of the step, summed as the fma GEMV sums). Opt-in (``set_fma_tiles(True)``, params
# ``bench_online.fma_tiles``, ``bench_decode.py --fma-tiles``, adds them to the tuner's candidates;
# ``bench_kernels.py --parts tiles --tile-candidates fma_tile`` times them): on an H200 at SmolLM2
# shapes they match the GEMV at n = 1 (Q/K/V 1.7 vs 1.6 us, LM head 27.6 vs 25.7 us) but their tokens run one
# after another, so n = 8 costs 3.5-4.5x n = 1 (Q/K/V 7.2 us) -- no cheaper verify, and a slower warm-up.
FMA_TILES = [("fma", 4, 1024, 4), ("fma", 2, 1024, 4), ("fma", 8, 1024, 8), ("fma", 16, 1024, 8), ("fma", 4, 2048, 8),
              ("fma", 2, 2048, 4), ("fma", 8, 512, 4), ("fma", 16, 512, 8), ("fma", 1, 2048, 4)]
FMA_TILES_TUNED = False  # whether the tuner also times FMA_TILES in mma mode (``set_fma_tiles``)
_TUNED: dict[tuple, tuple] = {}
TUNE = True  # False (``set_tuning``): every shape runs its first candidate, untimed
# The tuner times each candidate once per process, and near-equal candidates can swap between runs. In mma mode
# a configuration fixes the order of the sums, so two runs that picked differently give (each batch-invariant,
# both correct) different bf16 greedy outputs, MAL and speed. Pin them: ``pin_kernel_configs(FILE)`` (params
# ``bench_online.kernel_configs``, ``bench_decode.py --kernel-configs``; a file written by
# ``save_kernel_configs``, or a bench_decode JSON holding the table under "kernel_configs") fixes every shape it
# lists; others are tuned.
_PINNED: dict[str, tuple] = {}  # from ``pin_kernel_configs`` (wins)
_STORED: dict[str, tuple] = {}  # from the config store (``use_config_store``)


def set_tuning(on: bool) -> None:
    """Tune each new shape (True, the default) or run its first candidate untimed (False)."""
    global TUNE
    TUNE = bool(on)


def set_fma_tiles(on: bool) -> None:
    """Let the mma-mode tuner also time the FMA tiles (``FMA_TILES``; off by default)."""
    global FMA_TILES_TUNED
    FMA_TILES_TUNED = bool(on)


def mma_candidates() -> list[tuple]:
    """The mma-mode candidates the tuner times: ``MMA_CONFIGS``, plus ``FMA_TILES`` when ``set_fma_tiles(True)``."""
    return MMA_CONFIGS + FMA_TILES if FMA_TILES_TUNED else MMA_CONFIGS


def pin_kernel_configs(path: str | os.PathLike, device: torch.device | str) -> dict[str, tuple]:
    """Pin every shape listed in the table at ``path`` (``load_kernel_configs``); pins win over the config store
    and over configurations already chosen in this process. Returns the table."""
    pins = load_kernel_configs(path, device)
    for key in [k for k in _TUNED if config_key(k) in pins]:
        del _TUNED[key]
    _PINNED.update(pins)
    return pins


def is_fma_tile(cfg: tuple) -> bool:
    """An ``mma``-mode candidate that is an FMA tile (``_gemv_rows``) rather than a tensor-core one."""
    return cfg[0] == "fma"


TUNE_BYTES = 256 << 20  # the tuner reads at least this many weight bytes per timing (> an H200's 50 MB L2)


def weight_copies(w: torch.Tensor, min_bytes: int = TUNE_BYTES, max_copies: int = 16) -> list[torch.Tensor]:
    """``w`` and copies of it adding up to >= ``min_bytes`` (at most ``max_copies``): launches that take them in
    turn read their weights from DRAM, as a decode step does, not from the L2 that one small matrix launched over
    and over would live in (timed from L2, the tuner ranked Qwen3-4B's O / down tiles by noise, and the step moved
    between 2.9 and 3.8 ms from one process to the next on an H200)."""
    copies = min(max_copies, max(1, -(-min_bytes // (w.numel() * w.element_size()))))
    out = [w]
    try:
        out += [w.clone() for _ in range(copies - 1)]
    except torch.cuda.OutOfMemoryError:  # a full device: time from fewer copies (partly from L2) rather than fail
        print(f"kernels: no memory for {copies - 1} copies of a {tuple(w.shape)} weight; tuning on {len(out)}")
    return out


def graph_time_ms(launch, launches: int = 20, replays: int = 5) -> float:
    """ms per call of ``launch(i)`` (i = 0, 1, ...): ``launches`` calls captured in one CUDA graph (no host launch
    cost in the figure, and back-to-back launches overlap as in a decode step under PDL), the graph replayed
    ``replays`` times after one warm replay. Compiles outside the capture (first call)."""
    launch(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * launches)


def lookup(key: tuple) -> tuple | None:
    """The configuration chosen for ``key`` in this process, or pinned for it (a configuration file, then the
    config store); None when the shape is new."""
    if key in _TUNED:
        return _TUNED[key]
    pinned = _PINNED.get(config_key(key)) or _STORED.get(config_key(key))
    if pinned is not None:
        _TUNED[key] = pinned
    return pinned


def fastest(configs: list[tuple], cost: Callable[[tuple], float]) -> tuple:
    """The candidate of least ``cost(cfg)`` (ms); one that does not compile (resources) is skipped; configs[0]
    when none runs."""
    best, best_ms = configs[0], float("inf")
    for cfg in configs:
        try:
            ms = cost(cfg)
        except Exception:  # noqa: BLE001 - a config that does not compile is skipped
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best


def remember(key: tuple, cfg: tuple) -> tuple:
    """Record a newly chosen configuration (and add it to the config store, if one is in use)."""
    _TUNED[key] = cfg
    if _STORE["path"] is not None:
        _save_store(torch.device(key[-1]))
    return cfg


def config_key(key: tuple) -> str:
    """``mma|fma:n:N:K:gated:dtype`` -- a tuned shape as a JSON key (the device is the file's)."""
    mma, m, n_out, k, gated, dtype, _ = key
    return f"{'mma' if mma else 'fma'}:{m}:{n_out}:{k}:{int(gated)}:{str(dtype).replace('torch.', '')}"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"


def kernel_configs(device: torch.device | str = "cuda") -> dict:
    """The configurations chosen so far in this process on ``device``: ``{"device": name, "configs": {key: cfg}}``."""
    device = torch.device(device)
    configs = {config_key(k): list(v) for k, v in _TUNED.items() if torch.device(k[-1]).type == device.type}
    return {"device": device_name(device), "configs": dict(sorted(configs.items()))}


def save_kernel_configs(path: str | os.PathLike, device: torch.device | str = "cuda") -> None:
    from dspark_core.io import write_json

    write_json(path, kernel_configs(device))


def load_kernel_configs(path: str | os.PathLike, device: torch.device | str = "cuda") -> dict[str, tuple]:
    """Read a table written by ``save_kernel_configs`` (or a bench_decode JSON holding one under
    "kernel_configs"); ValueError naming the file when it is not one, or was made on another device."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"kernel configs {path}: cannot read a JSON table ({e}); delete the file (it is "
                        "tuned again)") from None
    data = data.get("kernel_configs", data) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise UserError(f"kernel configs {path}: no {{'device', 'configs'}} table in it; delete the file (it is "
                        "tuned again)")
    here = device_name(torch.device(device))
    if data.get("device") != here:
        raise UserError(f"kernel configs {path}: configurations tuned on {data.get('device')!r}, "
                        f"this device is {here!r}; delete the file or point the setting at this device's")
    out = {}
    for key, cfg in data["configs"].items():
        parsed = _parse_config(key.split(":")[0], cfg)
        if parsed is None:
            raise UserError(f"kernel configs {path}: bad entry {key!r}: {cfg!r}; delete the file (it is tuned again)")
        out[key] = parsed
    return out


def _parse_config(kind: str, cfg) -> tuple | None:
    """A stored configuration as the tuple ``_launch`` takes (None when it is not one of ``kind``'s)."""
    if not isinstance(cfg, list):
        return None
    if kind == "mma" and len(cfg) == 4 and cfg[0] == "fma" and all(isinstance(c, int) for c in cfg[1:]):
        return ("fma", *cfg[1:])
    sizes = {"mma": (4, 5, 6), "fma": (3,)}
    if kind not in sizes or len(cfg) not in sizes[kind] or not all(isinstance(c, int) for c in cfg):
        return None
    return tuple(cfg)


_STORE: dict = {"path": None, "fingerprint": None}


# -- the config store: a model's tuned tiles, kept per device and target fingerprint -------------------------------
def kernel_store_path(root: str | os.PathLike, device: torch.device | str, fingerprint: str):
    """``root/<device name>/<fingerprint[:16]>.json``: where the tiles tuned for a target on a device live."""
    import re
    from pathlib import Path

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name(torch.device(device))).strip("_")
    return Path(root).expanduser() / slug / f"{fingerprint[:16]}.json"


def use_config_store(path: str | os.PathLike, device: torch.device | str, fingerprint: str) -> dict[str, tuple]:
    """Pin every configuration stored in ``path`` (an earlier run of this target on this device) and add each
    shape tuned from now on to it, so that every later run picks the same tiles -- in ``mma`` mode the same
    sums, bit for bit -- without a pinned file. A configuration already chosen in this process for a stored
    shape is dropped (the store wins). A table pinned by ``pin_kernel_configs`` still wins over both.
    Returns the pinned table; ValueError naming the file when it is not one, or is another device's / target's."""
    import json
    from pathlib import Path

    path = Path(path)
    device = torch.device(device)
    pins: dict[str, tuple] = {}
    if path.is_file():
        pins = load_kernel_configs(path, device)
        stored = json.loads(path.read_text()).get("fingerprint")
        if stored != fingerprint:
            raise UserError(f"{path}: kernel configurations of target {stored!r}, this target is {fingerprint!r}; "
                            "delete the file (it is tuned again)")
    for key in [k for k in _TUNED if config_key(k) in pins]:
        del _TUNED[key]
    _STORED.clear()
    _STORED.update(pins)
    _STORE.update(path=path, fingerprint=fingerprint)
    return pins


def _save_store(device: torch.device) -> None:
    from dspark_core.io import write_json

    path = _STORE["path"]
    table = {k: list(v) for k, v in _STORED.items()}
    table.update(kernel_configs(device)["configs"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"device": device_name(device), "fingerprint": _STORE["fingerprint"],
                      "configs": dict(sorted(table.items()))})


def close_config_store() -> None:
    """Stop adding to the store (the pins stay)."""
    _STORE.update(path=None, fingerprint=None)
