"""Tests of the model registry: names, listing, lookup errors, params assembly.

Also a user's own experiments, outside tfpipe: found by import path with no
registration, listed when an installed package names their module under the
`tfpipe.experiments` entry points, and refused with the module's offer when
the class is misspelled.
"""

import sys
import textwrap

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
  # Its import path finds it too, and the listing keeps the short name.
  assert model_registry.GetClass('params.mlp.TinyMlp') is cls
  assert 'params.mlp.TinyMlp' not in model_registry.ListModels()


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


def test_registering_outside_params_package_uses_the_import_path():

  class Elsewhere(base_model_params.SingleTaskModelParams):
    pass

  Elsewhere.__module__ = 'my_project.experiments'
  try:
    assert model_registry.RegisterSingleTaskModel(Elsewhere) is Elsewhere
    assert model_registry.GetClass(
        'my_project.experiments.Elsewhere') is Elsewhere
  finally:
    model_registry._REGISTRY.pop('my_project.experiments.Elsewhere', None)  # pylint: disable=protected-access
  with pytest.raises(TypeError, match='SingleTaskModelParams'):
    model_registry.RegisterSingleTaskModel(hyperparams.Params)


_USER_EXPERIMENTS = textwrap.dedent("""\
    from params import mlp

    class MyMlp(mlp.TinyMlp):
      \"\"\"A user's experiment: TinyMlp, 3 partitions.\"\"\"
      NUM_PARTITIONS = 3

    class _Base(mlp.TinyMlp):
      pass

    class NotAnExperiment:
      pass
    """)


@pytest.fixture(name='user_package')
def fixture_user_package(tmp_path, monkeypatch):
  """A package `my_exps_<n>` outside tfpipe, on sys.path; the registry cleaned."""
  name = f'my_exps_{tmp_path.name.replace("-", "_")}'
  package = tmp_path / name
  package.mkdir()
  (package / '__init__.py').write_text('')
  (package / 'experiments.py').write_text(_USER_EXPERIMENTS)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(model_registry, '_REGISTRY',
                      dict(model_registry._REGISTRY))  # pylint: disable=protected-access
  yield name
  for module in [m for m in sys.modules if m.startswith(name)]:
    del sys.modules[module]


def test_own_class_by_import_path_needs_no_registration(user_package):
  name = f'{user_package}.experiments.MyMlp'
  p = model_registry.GetParams(name)
  assert p.model == name
  assert p.task.pipeline.num_partitions == 3
  assert model_registry.GetClass(name).__module__ == (
      f'{user_package}.experiments')
  assert model_registry.Describe(name) == (
      "A user's experiment: TinyMlp, 3 partitions.")
  assert name in model_registry.ListModels()


@pytest.mark.parametrize('class_name, message', [
    ('MyMlpp', r"'MyMlpp' is not defined there .*Did you mean 'MyMlp'\?"
               r' Experiments it defines: MyMlp\.'),
    ('NotAnExperiment', r"'NotAnExperiment' is not a subclass of "
                        r'base_model_params.SingleTaskModelParams'),
])
def test_wrong_class_in_an_existing_module_names_what_it_offers(
    user_package, class_name, message):
  with pytest.raises(model_registry.ModelNotFoundError, match=message):
    model_registry.GetClass(f'{user_package}.experiments.{class_name}')


def test_missing_module_says_how_to_name_a_class_of_ones_own():
  with pytest.raises(model_registry.ModelNotFoundError,
                     match=r'import path, e.g. --model=my_project.experiments'
                     r'.MyLm.*PYTHONPATH'):
    model_registry.GetClass('no_such_project.experiments.MyLm')


def test_a_broken_import_inside_the_users_module_surfaces(user_package,
                                                          tmp_path):
  (tmp_path / user_package / 'broken.py').write_text(
      'import no_such_dependency_of_the_user\n')
  with pytest.raises(ModuleNotFoundError,
                     match='no_such_dependency_of_the_user'):
    model_registry.GetClass(f'{user_package}.broken.MyLm')


def test_entry_points_of_installed_packages_are_listed(user_package,
                                                        tmp_path):
  # What `pip install` of a project with this in its pyproject.toml leaves:
  #   [project.entry-points."tfpipe.experiments"]
  #   my_exps = "my_exps.experiments"
  dist = tmp_path / f'{user_package}-0.1.dist-info'
  dist.mkdir()
  (dist / 'METADATA').write_text(
      f'Metadata-Version: 2.1\nName: {user_package}\nVersion: 0.1\n')
  (dist / 'entry_points.txt').write_text(
      f'[{model_registry.ENTRY_POINT_GROUP}]\n'
      f'{user_package} = {user_package}.experiments\n')
  assert f'{user_package}.experiments' in model_registry.EntryPointModules()
  names = model_registry.ListModels()
  assert f'{user_package}.experiments.MyMlp' in names
  assert f'{user_package}.experiments._Base' not in names
  assert 'lm.TinyTransformerLm' in names


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
