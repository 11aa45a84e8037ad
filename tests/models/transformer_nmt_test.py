"""Tests of the encoder-decoder builder: size, cost model, pipelining, learning."""

import numpy as np
import pytest
import tensorflow as tf

from models import transformer_nmt
from tests.models import layer_list
from tfpipe import gpipe
from tfpipe.trainer import input_generator
from tfpipe.trainer import task as task_lib


def _Model(**kwargs):
  defaults = dict(vocab_size=20, source_length=6, target_length=5,
                  model_dim=8, num_layers=2, num_heads=2, hidden_dim=16)
  defaults.update(kwargs)
  return transformer_nmt.TransformerNmt.Params().Set(**defaults).Instantiate()


def test_paper_shape_has_the_papers_parameter_count():
  """T(6, 8192, 16) at model dim 1024 and a 64k vocabulary: the paper's 400M."""
  model = _Model(vocab_size=64000, source_length=128, target_length=128,
                 model_dim=1024, num_layers=6, num_heads=16, hidden_dim=8192)
  d, h, v = 1024, 8192, 64000
  attention = 4 * d * d + 4 * d
  feed_forward = 2 * d * h + h + d
  norm = 2 * d
  encoder = attention + feed_forward + 2 * norm
  decoder = 2 * attention + feed_forward + 3 * norm
  want = (v * d + 6 * encoder + norm + 6 * decoder +  # The encoder's last LN.
          norm + d * v + v)  # Final LN and softmax.
  assert model.NumParams() == want == 408_209_920


def test_layer_list_runs_and_cost_model_matches():
  model = _Model()
  lps = model.LayerParamsList()
  assert [lp.name for lp in lps] == ['emb', 'encoder_0', 'encoder_1',
                                     'decoder_0', 'decoder_1', 'logits']
  assert model.InputShape() == (None, 11)
  ids = tf.constant(np.random.RandomState(0).randint(1, 20, size=(3, 11)))
  assert layer_list.RunAndCheckCostModel(model, ids) == (3, 5, 20)


def _Pipeline(model, num_partitions, num_micro_batches, inputs, targets):
  cells = gpipe.PartitionSequentialLayers(
      task_lib.SeededLayerParams(model, 7), num_partitions,
      input_shape=model.InputShape(), input_dtype=model.InputDtype())
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches,
      devices=[f'/CPU:{k}' for k in range(num_partitions)],
      compile_step=False).Instantiate()
  return cells, pipe.ComputeLossAndGradients(inputs, targets, model.Loss)


def test_pipelined_losses_and_gradients_equal_the_plain_models():
  """K=2, M=2 and K=4, M=4 against K=1, M=1, with padded sources."""
  model = _Model(dropout_prob=0.0)
  data = input_generator.TranslationTaskInput.Params().Set(
      batch_size=8, num_words=8, min_length=2, max_length=6, seed=2)
  inputs, targets = next(iter(data.Instantiate().GetDataset(0)))
  assert (inputs[:, :6].numpy() == 0).any()  # Some sources are padded.
  _, want = _Pipeline(model, 1, 1, inputs, targets)
  for k, m in ((2, 2), (4, 4)):
    cells, got = _Pipeline(model, k, m, inputs, targets)
    assert len(cells) == k
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
    np.testing.assert_allclose(got.metrics['accuracy'],
                               want.metrics['accuracy'], rtol=1e-5)
    for g, w in zip(got.gradients, want.gradients):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_num_layers_must_be_positive():
  with pytest.raises(ValueError, match='num_layers must be >= 1'):
    _Model(num_layers=0)
