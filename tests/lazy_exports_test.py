"""tfpipe.lazy_exports: package names that import their submodule on first use.

Users rely on two things: every name a package exported when its `__init__`
imported everything still resolves (`gpipe.PipeliningLayer`), and importing
one light module or package does not start TensorFlow.
"""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

import tfpipe
from tfpipe import gpipe
from tfpipe import keras as tfpipe_keras
from tfpipe import lazy_exports
from tfpipe import layers

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

# What each package exported before its __init__ became lazy: the names it
# imported, and the submodules those imports bound as attributes.
EXPORTED_BEFORE = {
    tfpipe: ['keras'],
    gpipe: [
        'BlockPartition', 'DefaultDevices', 'FeatureExtractionLayer',
        'FlattenSequentialLayers', 'GPipeSchedule', 'LossAndGradients',
        'MakeSchedule', 'OneFOneBSchedule', 'PartitionSequentialLayers',
        'PipeliningLayer', 'REMAT_POLICIES', 'ResolveDevices', 'Simulate',
        'TextTimeline', 'cell', 'dispatch', 'microbatch', 'partition',
        'pipelining_layer', 'runtime', 'schedule', 'stage'],
    tfpipe_keras: [
        'KerasCellLayer', 'ModelGraph', 'PipelinedModel', 'describe',
        'pipeline', 'costs', 'graph', 'model', 'cell'],
    layers: [
        'ACTIVATIONS', 'Activation', 'AmoebaCell', 'BatchNormLayer',
        'ClassifierHead', 'Conv2DLayer', 'DecoderLogits', 'DropoutLayer',
        'EmbeddingLayer', 'FCLayer', 'FactorizedReduce', 'KerasLayer',
        'LayerNorm', 'MaskedAttention', 'MultiHeadAttention', 'Pool2DLayer',
        'ReluConvBn', 'Seq2SeqEmbedding', 'SequentialLayer',
        'SoftmaxCrossEntropy', 'SoftmaxCrossEntropyLoss',
        'TransformerDecoderLayer', 'TransformerEncoderLayer',
        'TransformerLayer', 'amoeba', 'attention', 'conv', 'core',
        'embedding', 'keras_exact', 'keras_layer', 'losses', 'normalization',
        'seq2seq'],
}


def _RunPython(code):
  """Runs `code` in a fresh interpreter at the workspace root."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.parametrize('package', list(EXPORTED_BEFORE),
                         ids=lambda p: p.__name__)
def test_every_previously_exported_name_resolves_and_is_listed(package):
  listing = dir(package)
  for name in EXPORTED_BEFORE[package]:
    value = getattr(package, name)
    assert name in listing, f'{package.__name__}.{name} missing from dir()'
    if isinstance(value, type(sys)):
      assert value.__name__ == f'{package.__name__}.{name}'


@pytest.mark.parametrize('package', [gpipe, tfpipe_keras, layers],
                         ids=lambda p: p.__name__)
def test_names_are_the_submodule_objects_and_star_import_gets_them(package):
  namespace = {}
  star = f'from {package.__name__} import *'
  exec(star, namespace)  # pylint: disable=exec-used
  assert set(package.__all__) <= set(namespace)
  for name in package.__all__:
    value = getattr(package, name)
    assert namespace[name] is value
    owner = getattr(value, '__module__', None)
    if owner:  # Constants such as ACTIVATIONS have no __module__.
      assert getattr(importlib.import_module(owner), name) is value


def test_importing_packages_and_pure_modules_loads_no_tensorflow():
  out = _RunPython('''
      import sys
      import tfpipe, tfpipe.gpipe, tfpipe.layers, tfpipe.keras, tfpipe.trainer
      import models, params
      import tfpipe.gpipe.schedule, tfpipe.hyperparams
      print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))
  ''')
  assert out.strip() == '[]', f'loaded by a package import: {out}'


def test_first_use_imports_only_the_submodule_that_defines_the_name():
  out = _RunPython('''
      import sys
      from tfpipe import gpipe
      gpipe.MakeSchedule
      print('tfpipe.gpipe.schedule' in sys.modules,
            'tfpipe.gpipe.pipelining_layer' in sys.modules,
            'MakeSchedule' in vars(gpipe))
  ''')
  assert out.split() == ['True', 'False', 'True']


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
  """A package `lazy_demo` whose submodule counts its imports."""
  package = tmp_path / 'lazy_demo'
  package.mkdir()
  (package / '__init__.py').write_text(textwrap.dedent('''
      from tfpipe import lazy_exports
      __getattr__, __dir__, __all__ = lazy_exports.Attach(__name__, {
          'shapes': ['Square', 'Circle'],
          'empty': [],
      })
  '''))
  (package / 'shapes.py').write_text(textwrap.dedent('''
      import builtins
      builtins.lazy_demo_imports = getattr(builtins, 'lazy_demo_imports', 0) + 1
      class Square:
        pass
  '''))
  (package / 'empty.py').write_text('')
  monkeypatch.syspath_prepend(str(tmp_path))
  import builtins  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(builtins, 'lazy_demo_imports', 0, raising=False)
  yield importlib.import_module('lazy_demo')
  for name in [m for m in sys.modules if m.split('.')[0] == 'lazy_demo']:
    del sys.modules[name]


def test_submodule_is_imported_once_on_first_use(fake_package):
  import builtins  # pylint: disable=g-import-not-at-top
  assert builtins.lazy_demo_imports == 0
  first = fake_package.Square
  assert builtins.lazy_demo_imports == 1
  assert fake_package.Square is first
  assert fake_package.shapes.Square is first
  assert builtins.lazy_demo_imports == 1
  assert fake_package.__all__ == ['Circle', 'Square']
  assert {'Circle', 'Square', 'empty', 'shapes'} <= set(dir(fake_package))


def test_unknown_name_is_an_attribute_error_naming_it(fake_package):
  with pytest.raises(AttributeError, match="'lazy_demo' has no attribute "
                     "'Triangle'"):
    fake_package.Triangle  # pylint: disable=pointless-statement
  assert not hasattr(fake_package, 'Triangle')


def test_stale_table_entry_names_the_submodule_and_the_fix(fake_package):
  with pytest.raises(AttributeError,
                     match=r"re-exports 'Circle' from lazy_demo\.shapes, "
                     r'which does not define it; fix the table'):
    fake_package.Circle  # pylint: disable=pointless-statement


def test_a_name_exported_twice_is_refused():
  with pytest.raises(ValueError, match="'Square' from 'b' clashes with 'a'"):
    lazy_exports.Attach('pkg', {'a': ['Square'], 'b': ['Square']})
  with pytest.raises(ValueError, match="'a' from 'b' clashes"):
    lazy_exports.Attach('pkg', {'a': [], 'b': ['a']})
