"""Tests of SingleTaskModelParams, the base class of experiment configurations.

Protected properties: unimplemented parts fail naming the configuration;
the default evaluation input is the training input with its own name and a
different seed (so evaluation sees other examples) and leaves Train()
untouched; `Datasets()` lists exactly the dataset methods, which is what
`model_registry.GetParams` accepts as dataset names.
"""

import numpy as np
import pytest

from tfpipe import base_model_params
from tfpipe import model_registry
from tfpipe.trainer import input_generator


class _Config(base_model_params.SingleTaskModelParams):
  """Train plus an extra Dev dataset, constants and helpers."""

  BATCH_SIZE = 4

  def Train(self):
    return input_generator.SyntheticClassificationInput.Params().Set(
        name='train', batch_size=self.BATCH_SIZE, seed=3, input_dim=4,
        num_classes=2)

  def Dev(self):
    return self.Train().Set(name='dev', seed=9)

  def helper(self):
    return 1

  class Nested:
    pass


def test_unimplemented_parts_name_the_configuration():

  class Empty(base_model_params.SingleTaskModelParams):
    pass

  with pytest.raises(NotImplementedError, match=r'Empty must define Train\(\)'):
    Empty().Train()
  with pytest.raises(NotImplementedError, match=r'Empty must define Task\(\)'):
    Empty().Task()
  with pytest.raises(NotImplementedError, match='Empty must define Train'):
    Empty().Test()


def test_test_is_train_with_a_new_name_and_seed():
  config = _Config()
  test = config.Test()
  train = config.Train()
  assert test.name == 'test' and train.name == 'train'
  assert test.seed == train.seed + (
      base_model_params.SingleTaskModelParams.TEST_SEED_OFFSET)
  assert test.batch_size == train.batch_size
  # Everything else equal.
  assert test.Copy().Set(name='train', seed=train.seed) == train


def test_test_input_sees_other_examples():
  config = _Config()
  train = next(iter(config.Train().Instantiate().GetDataset(0)))
  test = next(iter(config.Test().Instantiate().GetDataset(0)))
  again = next(iter(config.Train().Instantiate().GetDataset(0)))
  np.testing.assert_array_equal(train[0].numpy(), again[0].numpy())
  assert not np.allclose(train[0].numpy(), test[0].numpy())


def test_datasets_lists_exactly_the_dataset_methods():
  assert _Config.Datasets() == ['Dev', 'Test', 'Train']
  assert base_model_params.SingleTaskModelParams.Datasets() == ['Test', 'Train']


def test_registry_accepts_the_listed_datasets():
  cls = model_registry.GetClass('mlp.TinyMlp')
  assert cls.Datasets() == ['Test', 'Train']
  p = model_registry.GetParams('mlp.TinyMlp', 'Train', 'Test')
  assert p.eval_input.seed == p.input.seed + cls.TEST_SEED_OFFSET
  with pytest.raises(ValueError, match=r"offers \['Test', 'Train'\]"):
    model_registry.GetParams('mlp.TinyMlp', 'Dev')
