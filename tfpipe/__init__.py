"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 and Keras 3.

Data flows one way through the package:
  hyperparams -> base_layer -> layers -> gpipe (partition, microbatch,
  schedule, executor) -> trainer; `tfpipe.keras` wraps Keras models into the
  same engine; `tfpipe.devices` splits local devices and `tfpipe.multihost`
  runs the pipeline on the workers of a cluster.
"""

from tfpipe import lazy_exports

__version__ = '0.1.0'

# `tfpipe.keras` is imported on first use, so `import tfpipe` stays light.
__getattr__, __dir__, __all__ = lazy_exports.Attach(__name__, {
    'keras': [],
})
