"""Tests of the conv classifier builder: blocks, shapes, cost model, batch norm."""

import numpy as np
import tensorflow as tf

from models import conv_classifier
from tests.models import layer_list


def test_layer_list_runs_and_cost_model_matches():
  model = conv_classifier.ConvClassifier.Params().Set(
      image_size=8, channels=2, num_classes=5, base_width=4,
      blocks_per_stage=[2, 1]).Instantiate()
  lps = model.LayerParamsList()
  assert [lp.name for lp in lps] == [
      'stem', 'stage0_block0', 'stage0_block1', 'stage1_block0', 'pool',
      'logits']
  x = tf.random.normal((3, 8, 8, 2))
  assert layer_list.RunAndCheckCostModel(model, x, training=True) == (3, 5)


def test_residual_block_projects_only_when_shapes_change():
  same = conv_classifier.ResidualBlock.Params().Set(
      name='b', in_channels=4, out_channels=4).Instantiate()
  assert 'proj' not in same.children
  down = conv_classifier.ResidualBlock.Params().Set(
      name='b', in_channels=4, out_channels=8, stride=2).Instantiate()
  assert 'proj' in down.children
  out = down(tf.random.normal((2, 6, 6, 4)), training=False)
  assert out.shape == (2, 3, 3, 8)
  assert float(tf.reduce_min(out)) >= 0.0  # Ends in a ReLU.


def test_global_average_pool():
  layer = conv_classifier.GlobalAveragePoolLayer.Params().Set(
      name='pool').Instantiate()
  x = tf.reshape(tf.range(8, dtype=tf.float32), (1, 2, 2, 2))
  np.testing.assert_allclose(layer(x), [[3.0, 4.0]])
