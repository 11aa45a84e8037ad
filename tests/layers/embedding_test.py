"""Tests of EmbeddingLayer against a plain gather."""

import math

import numpy as np
import pytest

from tfpipe import layers


@pytest.mark.parametrize('scale', [False, True])
def test_embedding_matches_gather(scale):
  p = layers.EmbeddingLayer.Params().Set(
      name='emb', vocab_size=10, embedding_dim=4, scale_sqrt_depth=scale,
      random_seed=0)
  emb = p.Instantiate()
  ids = np.array([[1, 0, 9], [3, 3, 2]], np.int32)
  want = emb.emb.numpy()[ids] * (math.sqrt(4) if scale else 1.0)
  got = emb(ids)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
  meta = layers.EmbeddingLayer.FPropMeta(p, (None, 3))
  assert meta.output_shape == (None, 3, 4)
  assert tuple(got.shape) == (2, 3, 4)
  assert meta.num_params == 40
  assert meta.activation_bytes == 4 * 3 * 4
