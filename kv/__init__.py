"""The unified paged KV cache: layer specs, pools, page allocation, block tables and prefix reuse."""

from kv.allocator import PageAllocator, chain_hash
from kv.manager import KVCacheManager, PrefixHit
from kv.pool import KVPool, LayerLocation
from kv.spec import KVLayerSpec, LayerOwner, dtype_name, make_layer_specs, parse_dtype

__all__ = ["KVCacheManager", "KVLayerSpec", "KVPool", "LayerLocation", "LayerOwner", "PageAllocator", "PrefixHit",
           "chain_hash", "dtype_name", "make_layer_specs", "parse_dtype"]
