"""KV caches: what a decode step reads besides the weights, and the layouts that hold it.

    kv_cache.py       the contiguous cache (KVCache): one (batch, Hkv, max_seq_len, hd) buffer per layer, allocated up
                      front and filled as tokens arrive
    static_cache.py   a fixed-size cache for CUDA graphs (StaticKVCache): positions as tensors, a mask per step
    block_manager.py  the paged cache's allocator (pure Python): free list, block tables, reference counts
    paged_cache.py    paged attention's cache (PagedKVCache): fixed-size blocks in one pool, read through block tables
    kv_quant.py       a cache stored in int8 or fp8 e4m3, one scale per token and head (QuantizedKVCache)
    prefix_reuse.py   prefix caching: blocks of a shared prompt prefix kept and reused across requests
    sizing.py         bytes per token, whether a cache fits, how much a layout wastes (no cache imported)
"""
