"""tfpipe.keras: pipeline an existing Sequential or functional Keras model.

`pipeline(model, ...)` cuts the model's layer graph into balanced cells and
runs them on tfpipe's GPipe engine, returning a keras.Model that shares the
original model's layers and variables. See model.py for the design.
"""

from tfpipe import lazy_exports

# Submodules are imported on first use: see tfpipe/lazy_exports.py.
__getattr__, __dir__, __all__ = lazy_exports.Attach(__name__, {
    'costs': [],
    'graph': ['ModelGraph'],
    'model': ['describe', 'pipeline', 'PipelinedModel'],
    'cell': ['KerasCellLayer'],
})
