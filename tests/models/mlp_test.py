"""Tests of the MLP builder: layer list, optional dropout, loss."""

import numpy as np
import pytest
import tensorflow as tf

from models import mlp


def test_layer_list():
  model = mlp.Mlp.Params().Set(input_dim=5, hidden_dim=7, num_hidden_layers=2,
                               num_classes=3).Instantiate()
  lps = model.LayerParamsList()
  assert [lp.name for lp in lps] == ['fc_0', 'fc_1', 'logits']
  x = tf.random.normal((4, 5))
  for lp in lps:
    x = lp.Instantiate()(x)
  assert x.shape == (4, 3)
  assert model.InputShape() == (None, 5)
  with_dropout = mlp.Mlp.Params().Set(num_hidden_layers=2, dropout_prob=0.5)
  names = [lp.name for lp in with_dropout.Instantiate().LayerParamsList()]
  assert names == ['fc_0', 'dropout_0', 'fc_1', 'dropout_1', 'logits']


def test_classification_loss():
  logits = tf.constant([[2.0, 0.0], [0.0, 2.0]])
  loss, metrics = mlp.ClassificationLoss(logits, tf.constant([0, 0]))
  want = (np.log1p(np.exp(-2.0)) + np.log1p(np.exp(2.0))) / 2
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(metrics['accuracy']) == pytest.approx(0.5)
