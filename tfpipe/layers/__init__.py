"""tfpipe layers: Lingvo-style layers built from params, usable as Keras layers.

Import the package and reach layers by name, e.g.
`from tfpipe import layers; layers.FCLayer.Params().Set(...)`.
Every layer creates its variables in `__init__` from its params and has an
exact `FPropMeta` cost model, which the GPipe partitioner relies on.
"""

from tfpipe.layers.attention import MultiHeadAttention
from tfpipe.layers.attention import TransformerLayer
from tfpipe.layers.conv import Conv2DLayer
from tfpipe.layers.core import ACTIVATIONS
from tfpipe.layers.core import Activation
from tfpipe.layers.core import DropoutLayer
from tfpipe.layers.core import FCLayer
from tfpipe.layers.core import SequentialLayer
from tfpipe.layers.embedding import EmbeddingLayer
from tfpipe.layers.keras_layer import KerasLayer
from tfpipe.layers.losses import SoftmaxCrossEntropy
from tfpipe.layers.losses import SoftmaxCrossEntropyLoss
from tfpipe.layers.normalization import BatchNormLayer
from tfpipe.layers.normalization import LayerNorm

__all__ = [
    'ACTIVATIONS',
    'Activation',
    'BatchNormLayer',
    'Conv2DLayer',
    'DropoutLayer',
    'EmbeddingLayer',
    'FCLayer',
    'KerasLayer',
    'LayerNorm',
    'MultiHeadAttention',
    'SequentialLayer',
    'SoftmaxCrossEntropy',
    'SoftmaxCrossEntropyLoss',
    'TransformerLayer',
]
