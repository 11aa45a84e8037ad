"""tfpipe.keras: pipeline an existing Sequential or functional Keras model.

`pipeline(model, ...)` cuts the model's layer graph into balanced stages and
runs them on tfpipe's GPipe engine, returning a keras.Model that shares the
original model's layers and variables. See model.py for the design.
"""

from tfpipe.keras.graph import ModelGraph
from tfpipe.keras.model import describe
from tfpipe.keras.model import pipeline
from tfpipe.keras.model import PipelinedModel
from tfpipe.keras.stage import KerasStageLayer
