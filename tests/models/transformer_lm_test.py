"""Tests of the Transformer LM builder: layer list, shapes, costs, loss masking."""

import numpy as np
import pytest
import tensorflow as tf

from models import transformer_lm
from tests.models import layer_list


def _Model(**kwargs):
  return transformer_lm.TransformerLm.Params().Set(
      vocab_size=11, sequence_length=6, model_dim=8, num_layers=3,
      num_heads=2, hidden_dim=16, **kwargs).Instantiate()


def test_layer_list_runs_and_cost_model_matches():
  model = _Model()
  lps = model.LayerParamsList()
  assert [lp.name for lp in lps] == [
      'emb', 'pos_emb', 'block_0', 'block_1', 'block_2', 'final_ln', 'logits']
  x = tf.constant(np.random.RandomState(0).randint(0, 11, size=(3, 6)))
  assert model.InputShape() == (None, 6)
  assert layer_list.RunAndCheckCostModel(model, x) == (3, 6, 11)
  assert model.InputDtype() == 'int32'


def test_positional_embedding_adds_per_position():
  layer = transformer_lm.PositionalEmbeddingLayer.Params().Set(
      name='pos', max_length=5, embedding_dim=3).Instantiate()
  out = layer(tf.zeros([2, 4, 3]))
  np.testing.assert_allclose(out[0], layer.pos_emb.numpy()[:4])
  np.testing.assert_allclose(out[1], out[0])
  with pytest.raises(ValueError, match='max_length'):
    transformer_lm.PositionalEmbeddingLayer.Params().Set(
        name='pos', embedding_dim=3).Instantiate()


def test_loss_ignores_negative_targets():
  logits = tf.constant([[[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]]])
  loss, metrics = transformer_lm.LmLoss(logits, tf.constant([[0, 0, -1]]))
  want = (np.log1p(np.exp(-5.0)) + np.log1p(np.exp(5.0))) / 2
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(metrics['accuracy']) == pytest.approx(0.5)
