"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 and Keras 3.

Data flows one way through the package:
  hyperparams -> base_layer -> layers -> gpipe (partition, microbatch,
  schedule, executor) -> trainer; `tfpipe.keras` wraps Keras models into the
  same engine and `tfpipe.cluster` names devices, local and multi-host.
"""

__version__ = '0.1.0'


def __getattr__(name):
  """Imports `tfpipe.keras` on first use, so `import tfpipe` stays light."""
  if name == 'keras':
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module('tfpipe.keras')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
