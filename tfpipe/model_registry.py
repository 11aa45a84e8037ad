"""Registry of experiment configurations, looked up by name from the command line.

The trainer is given `--model=lm.TinyTransformerLm`; this module maps that
name to the class defined in `params/lm.py` and builds its params. The name is
derived from where the class lives (module path under the top-level `params`
package, then the class name), so it never drifts from the code, and modules
are imported only when a name asks for them.

Usage:

  @model_registry.RegisterSingleTaskModel
  class TinyTransformerLm(base_model_params.SingleTaskModelParams):
    ...

  p = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
  p.task, p.input, p.eval_input
"""

import difflib
import importlib
import pkgutil

from tfpipe import base_model_params
from tfpipe import hyperparams

PARAMS_PACKAGE = 'params'

_REGISTRY = {}


class ModelNotFoundError(LookupError):
  """No registered experiment has the requested name."""


def _RegisteredName(cls):
  module = cls.__module__
  prefix = PARAMS_PACKAGE + '.'
  if not module.startswith(prefix):
    raise ValueError(
        f'RegisterSingleTaskModel: {cls.__qualname__} is defined in module '
        f'{module!r}; registered configurations must live in a module under '
        f'the top-level {PARAMS_PACKAGE!r} package (e.g. params/lm.py).')
  return module[len(prefix):] + '.' + cls.__name__


def RegisterSingleTaskModel(cls):
  """Class decorator registering an experiment as `<module under params>.<Class>`."""
  if not (isinstance(cls, type) and
          issubclass(cls, base_model_params.SingleTaskModelParams)):
    raise TypeError(
        f'RegisterSingleTaskModel expects a subclass of '
        f'SingleTaskModelParams; received {cls!r}.')
  name = _RegisteredName(cls)
  old = _REGISTRY.get(name)
  if old is not None and old is not cls and (
      old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
    raise ValueError(f'Model {name!r} is already registered by {old!r}.')
  _REGISTRY[name] = cls
  return cls


def _ImportModuleFor(name):
  """Imports `params.<module>` for a registered name `<module>.<Class>`."""
  if '.' not in name:
    return
  module_name = PARAMS_PACKAGE + '.' + name.rsplit('.', 1)[0]
  try:
    importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    # A missing module means an unknown name; a missing import inside an
    # existing module is a real error and must surface.
    if e.name is None or not module_name.startswith(e.name):
      raise


def _ImportAllParamsModules():
  package = importlib.import_module(PARAMS_PACKAGE)
  for info in pkgutil.walk_packages(package.__path__, PARAMS_PACKAGE + '.'):
    importlib.import_module(info.name)


def GetAllRegisteredClasses():
  """Imports every module under `params` and returns {name: class}."""
  _ImportAllParamsModules()
  return dict(sorted(_REGISTRY.items()))


def ListModels():
  """Sorted names of every registered experiment."""
  return list(GetAllRegisteredClasses())


def GetClass(name):
  """The configuration class registered as `name`, importing its module if needed."""
  if name not in _REGISTRY:
    _ImportModuleFor(name)
  if name not in _REGISTRY:
    known = ListModels()
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    msg = f'Unknown model {name!r}.'
    if close:
      msg += ' Did you mean ' + ' or '.join(repr(c) for c in close) + '?'
    msg += ' Registered models: ' + ', '.join(known) + '.'
    raise ModelNotFoundError(msg)
  return _REGISTRY[name]


def GetParams(name, dataset='Train', eval_dataset='Test'):
  """The experiment params of `name`: `model`, `task`, `input`, `eval_input`.

  Args:
    name: registered name, e.g. 'lm.TinyTransformerLm'.
    dataset: method of the configuration that gives `p.input` ('Train', ...).
    eval_dataset: method that gives `p.eval_input`.

  Returns:
    A hyperparams.Params tree.
  """
  cls = GetClass(name)
  config = cls()
  inputs = {}
  for which, method in (('dataset', dataset), ('eval_dataset', eval_dataset)):
    fn = getattr(config, method, None)
    if method not in cls.Datasets() or fn is None:
      raise ValueError(
          f'{which}={method!r}: model {name!r} has no such dataset; it '
          f'offers {cls.Datasets()}.')
    inputs[which] = fn()
  p = hyperparams.Params()
  p.Define('model', name, 'Registered name of this experiment.')
  p.Define('task', config.Task(), 'Params of the task being trained.')
  p.Define('input', inputs['dataset'], 'Params of the training input.')
  p.Define('eval_input', inputs['eval_dataset'],
           'Params of the evaluation input.')
  return p
