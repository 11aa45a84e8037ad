"""tfpipe layers: Lingvo-style layers built from params, usable as Keras layers.

Import the package and reach layers by name, e.g.
`from tfpipe import layers; layers.FCLayer.Params().Set(...)`.
Every layer creates its variables in `__init__` from its params and has an
exact `FPropMeta` cost model, which the GPipe partitioner relies on.
"""

from tfpipe import lazy_exports

# Submodules are imported on first use: see tfpipe/lazy_exports.py.
__getattr__, __dir__, __all__ = lazy_exports.Attach(__name__, {
    'amoeba': [
        'AmoebaCell',
        'ClassifierHead',
        'FactorizedReduce',
        'Pool2DLayer',
        'ReluConvBn',
    ],
    'attention': ['MultiHeadAttention', 'TransformerLayer'],
    'conv': ['Conv2DLayer'],
    'core': [
        'ACTIVATIONS',
        'Activation',
        'DropoutLayer',
        'FCLayer',
        'SequentialLayer',
    ],
    'embedding': ['EmbeddingLayer'],
    'keras_exact': [],
    'keras_layer': ['KerasLayer'],
    'losses': ['SoftmaxCrossEntropy', 'SoftmaxCrossEntropyLoss'],
    'normalization': ['BatchNormLayer', 'LayerNorm'],
    'seq2seq': [
        'DecoderLogits',
        'MaskedAttention',
        'Seq2SeqEmbedding',
        'TransformerDecoderLayer',
        'TransformerEncoderLayer',
    ],
})
