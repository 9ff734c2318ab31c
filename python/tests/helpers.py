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
