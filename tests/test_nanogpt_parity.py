"""jdp's GPT is nanoGPT's model: from nanoGPT's initialisation (`jdp.models.gpt_from_nanogpt`), over the
same batches, nanoGPT's train.py recipe (clip 1.0, AdamW decaying the matrices only) in jdp's step and in
PyTorch gives the same losses. Needs PyTorch (the `bench` extra); skipped without it."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed: the nanoGPT peer needs the bench extra "
                                    "(pip install -e '.[bench]')")

from benchmarks.nanogpt import losses_side_by_side  # noqa: E402

TINY = dict(vocab=65, context=16, d_model=32, n_heads=2, n_layers=2, batch=4)


@pytest.mark.parametrize("bias", [True, False])
def test_jdp_trains_nanogpts_model_step_for_step(bias):
    """Initial logits to ~1e-5, then 20 AdamW steps whose losses agree to 1e-4 while the loss falls
    (the stream has learnable structure, so a wrong model or optimizer would show)."""
    side = losses_side_by_side(TINY, steps=20, bias=bias)
    np.testing.assert_allclose(side["jdp_logits"], side["peer_logits"], atol=1e-5)
    np.testing.assert_allclose(side["jdp_losses"], side["peer_losses"], atol=1e-4)
    assert side["peer_losses"][-1] < side["peer_losses"][0] - 0.1, side["peer_losses"]
