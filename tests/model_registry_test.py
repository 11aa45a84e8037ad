"""Tests of the model registry: names, listing, lookup errors, params assembly."""

import pytest

from tfpipe import base_model_params
from tfpipe import hyperparams
from tfpipe import model_registry


def test_names_derive_from_module_path():
  names = model_registry.ListModels()
  for name in ('lm.TinyTransformerLm', 'lm.SmallTransformerLm',
               'lm.LargeTransformerLm', 'image.TinyConvClassifier',
               'image.SmallConvClassifier', 'image.LargeConvClassifier',
               'mlp.TinyMlp', 'mlp.SmallMlp', 'mlp.LargeMlp'):
    assert name in names
  assert names == sorted(names)
  classes = model_registry.GetAllRegisteredClasses()
  assert classes['lm.TinyTransformerLm'].__name__ == 'TinyTransformerLm'


def test_nested_packages_give_dotted_names():

  class Nested(base_model_params.SingleTaskModelParams):
    pass

  Nested.__module__ = 'params.research.lm'
  try:
    assert model_registry.RegisterSingleTaskModel(Nested) is Nested
    assert model_registry.GetClass('research.lm.Nested') is Nested
  finally:
    model_registry._REGISTRY.pop('research.lm.Nested', None)  # pylint: disable=protected-access


def test_get_class_imports_on_demand():
  cls = model_registry.GetClass('mlp.TinyMlp')
  assert cls.__module__ == 'params.mlp'


def test_get_params_assembles_the_experiment():
  p = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
  assert p.model == 'lm.TinyTransformerLm'
  assert p.input.name == 'train'
  assert p.eval_input.name == 'test'
  assert p.eval_input.seed != p.input.seed
  assert p.task.pipeline.num_partitions == 2
  # The whole tree prints and round-trips through text.
  q = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
  q.task.train.learning_rate = 0.5
  assert 'task.train.learning_rate' in p.TextDiff(q)
  q.FromText(p.ToText())
  assert q == p


def test_unknown_name_lists_near_matches():
  with pytest.raises(model_registry.ModelNotFoundError) as e:
    model_registry.GetClass('lm.TinyTransformerLM')
  assert "Did you mean 'lm.TinyTransformerLm'" in str(e.value)
  with pytest.raises(model_registry.ModelNotFoundError) as e:
    model_registry.GetClass('nosuchmodule.Model')
  assert 'Registered models:' in str(e.value)


def test_unknown_dataset_names_what_exists():
  with pytest.raises(ValueError, match=r"dataset='Dev'.*\['Test', 'Train'\]"):
    model_registry.GetParams('mlp.TinyMlp', 'Dev')


def test_registering_outside_params_package_fails():

  class Elsewhere(base_model_params.SingleTaskModelParams):
    pass

  with pytest.raises(ValueError, match="top-level 'params' package"):
    model_registry.RegisterSingleTaskModel(Elsewhere)
  with pytest.raises(TypeError, match='SingleTaskModelParams'):
    model_registry.RegisterSingleTaskModel(hyperparams.Params)


def test_default_test_input_is_train_with_another_seed():

  class Config(base_model_params.SingleTaskModelParams):

    def Train(self):
      p = hyperparams.Params()
      p.Define('name', 'train', 'Name.')
      p.Define('seed', 3, 'Seed.')
      return p

  test = Config().Test()
  assert test.name == 'test'
  assert test.seed == 3 + Config.TEST_SEED_OFFSET
  assert Config.Datasets() == ['Test', 'Train']
