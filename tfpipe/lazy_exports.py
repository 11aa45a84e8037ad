"""Package re-exports that import their submodule on first use (PEP 562).

Why: a package `__init__` that eagerly imports its submodules makes every
import of any one module pay for all of them. `import tfpipe.gpipe.schedule`
(pure Python) would load TensorFlow and Keras through `tfpipe/gpipe/__init__`,
and in Bazel each module's target would have to carry the whole package: the
import cycles `tools/build_targets.py` refuses.

With lazy exports, `from tfpipe import gpipe; gpipe.PipeliningLayer` still
works, but `tfpipe.gpipe.pipelining_layer` is imported only when the name is
first read. A package declares its exports as one literal table:

    from tfpipe import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports.Attach(__name__, {
        'schedule': ['GPipeSchedule', 'MakeSchedule'],  # names re-exported
        'partition': ['BlockPartition'],
        'keras': [],  # the submodule itself only: `tfpipe.keras`
    })

Each key is a submodule (relative to the package), which is also reachable
as an attribute (`gpipe.schedule`); one that exports no names is listed with
[] so that `gpipe.microbatch` works as it did when the `__init__` imported
everything. The table must stay a literal: `tools/build_targets.py` reads it
to give the package's Bazel bundle (`//tfpipe/gpipe`) the modules it can load.
"""

import importlib
import sys


def Attach(package, table):
  """Returns (__getattr__, __dir__, __all__) for the package named `package`.

  Args:
    package: the package's `__name__`.
    table: {submodule: [names it defines that the package re-exports]}.

  Raises:
    ValueError: a name is exported from two submodules, or a submodule name
      is also exported as a name.
  """
  origin = {}
  for module, names in table.items():
    for name in names:
      if name in origin or name in table:
        raise ValueError(
            f'{package}: lazy export {name!r} from {module!r} clashes with '
            f'{origin.get(name, name)!r}; export each name once.')
      origin[name] = module

  def __getattr__(name):  # pylint: disable=invalid-name
    if name in table:
      return importlib.import_module(f'{package}.{name}')
    if name not in origin:
      raise AttributeError(f'module {package!r} has no attribute {name!r}')
    module = importlib.import_module(f'{package}.{origin[name]}')
    try:
      value = getattr(module, name)
    except AttributeError:
      raise AttributeError(
          f'{package} re-exports {name!r} from {module.__name__}, which does '
          f'not define it; fix the table in {package}/__init__.py.') from None
    # Cache it: later reads are plain module attributes.
    setattr(sys.modules[package], name, value)
    return value

  def __dir__():  # pylint: disable=invalid-name
    return sorted(set(vars(sys.modules[package])) | set(origin) | set(table))

  return __getattr__, __dir__, sorted(origin)
