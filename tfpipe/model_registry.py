"""Registry of experiment configurations, looked up by name from the command line.

The trainer is given `--model=NAME`. NAME is one of:

* a configuration shipped with tfpipe, named after where it lives under the
  top-level `params` package: `lm.TinyTransformerLm` is the class
  `TinyTransformerLm` of `params/lm.py`;
* the import path of a class of your own, anywhere on `sys.path`:
  `my_project.experiments.MyLm` is the class `MyLm` of
  `my_project/experiments.py`. No registration and no change to tfpipe is
  needed; the class subclasses `base_model_params.SingleTaskModelParams`.

Names derive from where a class lives, so they never drift from the code,
and modules are imported only when a name asks for them. Listing every
experiment (`ListModels`, the trainer's `--mode=list_models` and its
unknown-model error) imports the `params` package and the modules that
installed packages name under the entry-point group `tfpipe.experiments`
(ENTRY_POINT_GROUP), e.g. in a project's pyproject.toml:

  [project.entry-points."tfpipe.experiments"]
  my_project = "my_project.experiments"

Usage:

  @model_registry.RegisterSingleTaskModel   # optional outside `params`
  class TinyTransformerLm(base_model_params.SingleTaskModelParams):
    ...

  p = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
  p.task, p.input, p.eval_input
"""

import difflib
import importlib
from importlib import metadata
import inspect
import pkgutil

from tfpipe import base_model_params
from tfpipe import hyperparams

PARAMS_PACKAGE = 'params'
ENTRY_POINT_GROUP = 'tfpipe.experiments'

_REGISTRY = {}


class ModelNotFoundError(LookupError):
  """No experiment has the requested name."""


def RegisteredName(cls):
  """`lm.TinyTransformerLm` under `params`, else the import path `module.Class`."""
  prefix = PARAMS_PACKAGE + '.'
  module = cls.__module__
  if module.startswith(prefix):
    module = module[len(prefix):]
  return module + '.' + cls.__name__


def _IsExperiment(obj):
  return (isinstance(obj, type) and
          issubclass(obj, base_model_params.SingleTaskModelParams) and
          obj is not base_model_params.SingleTaskModelParams)


def RegisterSingleTaskModel(cls):
  """Class decorator registering an experiment under `RegisteredName(cls)`."""
  if not _IsExperiment(cls):
    raise TypeError(
        f'RegisterSingleTaskModel expects a subclass of '
        f'SingleTaskModelParams; received {cls!r}.')
  name = RegisteredName(cls)
  old = _REGISTRY.get(name)
  if old is not None and old is not cls and (
      old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
    raise ValueError(f'Model {name!r} is already registered by {old!r}.')
  _REGISTRY[name] = cls
  return cls


def _ImportIfExists(module_name):
  """The module, or None if it (or a package above it) does not exist.

  A missing import inside an existing module is a real error and surfaces.
  """
  try:
    return importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is None or not (module_name + '.').startswith(e.name + '.'):
      raise
    return None


def _ExperimentsOf(module):
  """{registered name: class} of the experiment classes a module defines."""
  return {RegisteredName(obj): obj for _, obj in inspect.getmembers(module)
          if _IsExperiment(obj) and obj.__module__ == module.__name__ and
          not obj.__name__.startswith('_')}


def _FindByImportPath(name):
  """The class `name` names as `<module>.<Class>`, or None.

  It is registered under its RegisteredName (which for a class under
  `params` is shorter than the import path that found it).

  Raises:
    ModelNotFoundError: the module exists but holds no such experiment.
  """
  module_name, _, class_name = name.rpartition('.')
  if not module_name:
    return None
  module = _ImportIfExists(module_name)
  if module is None:
    return None
  obj = getattr(module, class_name, None)
  if obj is None or not _IsExperiment(obj):
    offered = sorted(c.__name__ for c in _ExperimentsOf(module).values())
    what = ('is not a subclass of base_model_params.SingleTaskModelParams'
            if obj is not None else 'is not defined there')
    close = difflib.get_close_matches(class_name, offered, n=3, cutoff=0.5)
    hint = (' Did you mean ' + ' or '.join(repr(c) for c in close) + '?'
            if close else '')
    raise ModelNotFoundError(
        f'Model {name!r}: {class_name!r} {what} (module {module_name!r}, '
        f'{module.__file__}).{hint} Experiments it defines: '
        f'{", ".join(offered) or "none"}.')
  _REGISTRY.setdefault(RegisteredName(obj), obj)
  return obj


def EntryPointModules():
  """Module names that installed packages list under ENTRY_POINT_GROUP."""
  return sorted({ep.value.split(':')[0].strip()
                 for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)})


def _ImportAllExperiments():
  package = importlib.import_module(PARAMS_PACKAGE)
  for info in pkgutil.walk_packages(package.__path__, PARAMS_PACKAGE + '.'):
    importlib.import_module(info.name)
  for module_name in EntryPointModules():
    module = importlib.import_module(module_name)
    for name, cls in _ExperimentsOf(module).items():
      _REGISTRY.setdefault(name, cls)


def GetAllRegisteredClasses():
  """Imports every module of `params` and of the entry points; {name: class}."""
  _ImportAllExperiments()
  return dict(sorted(_REGISTRY.items()))


def ListModels():
  """Sorted names of every experiment tfpipe and the installed packages offer."""
  return list(GetAllRegisteredClasses())


def GetClass(name):
  """The experiment class `name` names, importing its module if needed."""
  if name in _REGISTRY:
    return _REGISTRY[name]
  if '.' in name:
    _ImportIfExists(PARAMS_PACKAGE + '.' + name.rsplit('.', 1)[0])
  cls = _REGISTRY.get(name) or _FindByImportPath(name)
  if cls is None:
    known = ListModels()
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    msg = f'Unknown model {name!r}.'
    if close:
      msg += ' Did you mean ' + ' or '.join(repr(c) for c in close) + '?'
    msg += (' Registered models: ' + ', '.join(known) + '. A class of your '
            'own is named by its import path, e.g. '
            '--model=my_project.experiments.MyLm, with its module '
            'importable (on PYTHONPATH).')
    raise ModelNotFoundError(msg)
  return cls


def GetParams(name, dataset='Train', eval_dataset='Test'):
  """The experiment params of `name`: `model`, `task`, `input`, `eval_input`.

  Args:
    name: registered name or import path, e.g. 'lm.TinyTransformerLm'.
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


def Describe(name):
  """The first line of the experiment's docstring, or ''."""
  doc = inspect.getdoc(GetClass(name)) or ''
  return doc.splitlines()[0] if doc else ''
