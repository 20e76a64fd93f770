"""Target cache: one target forward per sample -> zarr v3 store of aux layers + final normalised hidden state.

- :mod:`~dspark_core.cache.build`: ``CacheConfig`` (params section ``cache``), ``run_cache``, ``build_store``
- :mod:`~dspark_core.cache.home`: where the stores are kept (``cache.store_dir``) and linked as the DVC output
- :mod:`~dspark_core.cache.capture`: hooks capturing the aux layers, layer-id checks, batch plan
- :mod:`~dspark_core.cache.store`: zarr layout, codecs, manifest, crash-safe writer, size stats
- :mod:`~dspark_core.cache.dataset`: ``CacheDataset`` + ``CacheCollator`` for training
- :mod:`~dspark_core.cache.verify`: ``verify_cache`` (recompute random samples and compare)
"""

from dspark_core.cache.build import CacheConfig, build_store, run_cache
from dspark_core.cache.capture import check_layer_ids
from dspark_core.cache.dataset import CacheCollator, CacheDataset
from dspark_core.cache.store import read_manifest, store_stats
from dspark_core.cache.verify import verify_cache

__all__ = ["CacheConfig", "CacheCollator", "CacheDataset", "build_store", "check_layer_ids", "read_manifest",
           "run_cache", "store_stats", "verify_cache"]
