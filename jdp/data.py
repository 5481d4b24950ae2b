"""Datasets that need no download, as host numpy arrays."""
from __future__ import annotations

import numpy as np


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled 8×8 digits (1,797 images): a fixed, shuffled train/test split.

    Returns `(x_train, y_train, x_test, y_test)`: x float32 in [0, 1] of shape (n, 64), y int32.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be strictly between 0 and 1.")
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]
