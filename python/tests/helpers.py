# SPDX-License-Identifier: Apache-2.0
"""What the tests and their peer processes share: deterministic byte patterns and digests."""

import hashlib

import numpy as np


def pattern(seed: int, n: int) -> np.ndarray:
    """n pseudo-random bytes, the same in every process for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def digest(arr) -> str:
    return hashlib.sha256(memoryview(arr).cast("B")).hexdigest()


def addr(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


def local_and_segment(e, t):
    """A zeroed buffer of target `t`'s size registered with engine `e`, and t's segment opened."""
    local = np.zeros(t["size"], np.uint8)
    e.register(local)
    return local, e.open_segment(t["name"])


LAYERS, BLOCKS, TOKENS, HEADS, HEAD_BYTES = 3, 16, 4, 2, 8
BLOCK_BYTES = HEADS * TOKENS * HEAD_BYTES


def kv_cache(seed, dtype=None):
    """A GQA KV cache of LAYERS layers (K and V, HND) in numpy arrays: returns (layout, arrays)
    where arrays[(layer, kind)] has BLOCKS blocks. seed None: zeros, else pattern(seed + ...)."""
    from kvbridge import kv
    arrays, slots = {}, []
    for layer in range(LAYERS):
        for kind in (kv.SlotKind.K, kv.SlotKind.V):
            n = BLOCKS * BLOCK_BYTES
            a = np.zeros(n, np.uint8) if seed is None else pattern(seed + 10 * layer + kind, n)
            arrays[(layer, int(kind))] = a
            slots.append(kv.Slot(layer, kind, addr(a), n, BLOCK_BYTES, BLOCKS, HEADS, HEAD_BYTES,
                                 kv.Order.HND))
    layout = kv.Layout("test-model", dtype or kv.DType.FP16, TOKENS, kv.Attn.GQA, HEADS, LAYERS,
                       slots)
    return layout, arrays


def block(arr, i):
    return arr[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]
