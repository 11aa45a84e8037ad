"""Tests of the AmoebaNet-D builder: published sizes, cost model, pipelining."""

import numpy as np
import pytest
import tensorflow as tf

from models import amoebanet
from tests.models import layer_list
from tfpipe import gpipe
from tfpipe.trainer import task as task_lib


def _Model(**kwargs):
  return amoebanet.AmoebaNetD.Params().Set(**kwargs).Instantiate()


# torchgpipe's benchmarks/amoebanetd-memory README (1000 classes, 224x224),
# the same (L, D) as GPipe's Table 1 (82M, 318M, 542M, 1.05B, 1.8B there).
@pytest.mark.parametrize('num_layers, num_filters, millions', [
    (18, 208, 81.5), (18, 416, 319.0), (18, 544, 542.7), (36, 544, 1060),
    (72, 512, 1840)])
def test_parameter_counts_match_the_published_ones(num_layers, num_filters,
                                                   millions):
  count = _Model(num_layers=num_layers, num_filters=num_filters).NumParams()
  digits = 1 if millions < 1000 else -1
  assert round(count / 1e6, digits) == millions


def test_image_size_changes_costs_but_not_parameters():
  small = _Model(num_layers=18, num_filters=256)
  large = _Model(num_layers=18, num_filters=256, image_size=480)
  assert small.NumParams() == large.NumParams() == 122_470_120


@pytest.mark.parametrize('imagenet_stem, image_size', [(True, 20), (False, 6)])
def test_layer_list_runs_and_cost_model_matches(imagenet_stem, image_size):
  model = _Model(num_layers=3, num_filters=16, image_size=image_size,
                 num_classes=5, imagenet_stem=imagenet_stem)
  names = [lp.name for lp in model.LayerParamsList()]
  stem_cells = ['stem_reduction_0', 'stem_reduction_1'] if imagenet_stem else []
  assert names == ['stem', *stem_cells, 'normal_0_0', 'reduction_0',
                   'normal_1_0', 'reduction_1', 'normal_2_0', 'head']
  x = tf.random.stateless_normal((2, image_size, image_size, 3), [1, 2])
  assert layer_list.RunAndCheckCostModel(model, x, training=True) == (2, 5)


@pytest.mark.parametrize('change, message', [
    (dict(num_layers=4), 'num_layers .L. must be a positive multiple of 3'),
    (dict(num_filters=20), 'num_filters .D. must be a multiple of 8'),
])
def test_bad_size_names_the_param(change, message):
  with pytest.raises(ValueError, match=message):
    _Model(**change)


def _PipelineLossAndGradients(model, num_partitions, inputs, targets):
  cells = gpipe.PartitionSequentialLayers(
      task_lib.SeededLayerParams(model, 1), num_partitions,
      input_shape=model.InputShape())
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=2,
      devices=[f'/CPU:{k}' for k in range(num_partitions)],
      remat_policy='never', compile_step=False).Instantiate()
  out = pipe.ComputeLossAndGradients(inputs, targets, model.Loss)
  return cells, out


def test_cells_pipeline_like_the_plain_model():
  """K=2 cells carrying (output, prev) give the loss and gradients of K=1.

  Batch norm normalizes each micro-batch on its own, so the reference keeps
  the two micro-batches and drops only the pipeline.
  """
  model = _Model(image_size=8, num_classes=4, num_layers=3, num_filters=8,
                 imagenet_stem=False)
  inputs = tf.random.stateless_normal((6, 8, 8, 3), [3, 4])
  targets = tf.constant([0, 1, 2, 3, 0, 1])
  _, want = _PipelineLossAndGradients(model, 1, inputs, targets)
  cells, got = _PipelineLossAndGradients(model, 2, inputs, targets)
  assert cells[1].sub[0].name.startswith(('normal', 'reduction'))
  np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
  assert len(got.gradients) == len(want.gradients)
  for g, w in zip(got.gradients, want.gradients):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
