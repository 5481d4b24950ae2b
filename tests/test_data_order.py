"""The documented epoch order, pinned to its formula rather than to jdp's own `epoch_order`.

Tests that compare batches with `epoch_order` pass for any permutation it returns; a shifted or
reseeded order would silently change every run's batches (and the configs' expected results).
"""
import numpy as np
import pytest

from jdp.data import epoch_order, make_batches


def documented(seed, epoch, n):
    """numpy's permutation(n) from a generator seeded with SeedSequence([seed, epoch])."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n)


@pytest.mark.parametrize("seed,epoch,n", [(0, 0, 10), (3, 1, 50), (7, 5, 1797)])
def test_epoch_order_is_the_documented_permutation(seed, epoch, n):
    np.testing.assert_array_equal(epoch_order(seed, epoch, n), documented(seed, epoch, n))


def test_batches_are_slices_of_the_documented_order():
    n, g = 40, 8
    it = make_batches({"id": np.arange(n)}, g, seed=3, prefetch=0)
    for epoch in range(2):
        order = documented(3, epoch, n)
        for step in range(n // g):
            np.testing.assert_array_equal(next(it)["id"], order[step * g:(step + 1) * g])
    it.close()
