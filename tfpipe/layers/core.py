"""Core tfpipe layers: fully connected, dropout and the sequential container.

These are the building blocks the other layer modules compose, and
`SequentialLayer` is the container the GPipe partitioner cuts into cells, so
its build order and cost model are what make pipelining placement correct.
The small helpers here (activations, dtype sizes, position counts) are shared
by every cost model in `tfpipe.layers`.
"""

import keras
import numpy as np
import tensorflow as tf

from tfpipe import base_layer

# Named activations, so params stay plain strings that print and parse.
ACTIVATIONS = {
    'none': tf.identity,
    'relu': tf.nn.relu,
    'relu6': tf.nn.relu6,
    'gelu': lambda x: tf.nn.gelu(x, approximate=False),
    'gelu_tanh': lambda x: tf.nn.gelu(x, approximate=True),
    'tanh': tf.math.tanh,
    'sigmoid': tf.math.sigmoid,
    'swish': tf.nn.silu,
    'softplus': tf.math.softplus,
}


def Activation(name):
  """The activation function called `name` (a key of ACTIVATIONS)."""
  if name not in ACTIVATIONS:
    raise ValueError(f'Unknown activation {name!r}; use one of '
                     f'{sorted(ACTIVATIONS)}.')
  return ACTIVATIONS[name]


def DtypeBytes(dtype):
  """Bytes per element of `dtype`, for activation-size estimates."""
  return tf.as_dtype(dtype).size


def BatchSize(shape):
  """Batch dim of a (nested) shape; 1 if unknown, so costs are per example."""
  batch = base_layer.BatchDim(shape)
  return 1 if batch is None else int(batch)


def Elements(shape):
  """Elements of a (nested) shape, an unknown batch dim counted as BatchSize."""
  return base_layer.NumElements(shape, BatchSize(shape))


def NumPositions(shape):
  """Elements of `shape` but its last dim: the rows a per-feature op runs on."""
  batch = BatchSize(shape)
  dims = [batch if d is None else int(d) for d in shape[:-1]]
  return int(np.prod(dims)) if dims else 1


def OutputBytes(shape, dtype):
  """Bytes of an activation of `shape`, counting an unknown batch as 1."""
  return float(DtypeBytes(dtype) *
               Elements(shape))


def ChildSeed(random_seed, i):
  """The seed of a layer's i-th child: None if the layer has none.

  Distinct per child, so that equally named variables of different children
  (every child has its own 'w') start from different values.
  """
  return None if random_seed is None else random_seed + 7919 * i


class FCLayer(base_layer.BaseLayer):
  """Fully connected layer act(x @ w + b) applied to the last dim.

  With `tied_embedding`, w is the named EmbeddingLayer's table, transposed,
  as a language model's softmax shares its input embedding: the layer owns
  only its bias. A pipeline gives the table a copy on this layer's cell when
  the two land in different cells (gpipe/tied_variables.py).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dims', 0, 'Size of the last dim of the input.')
    p.Define('output_dims', 0, 'Size of the last dim of the output.')
    p.Define('activation', 'relu', 'Name of the activation (see ACTIVATIONS).')
    p.Define('has_bias', True, 'Whether to add a learned bias.')
    p.Define('tied_embedding', None, 'Name of an EmbeddingLayer of the same '
             'network whose [output_dims, input_dims] table, transposed, is '
             'this layer\'s weight (tied input and output embeddings); None '
             'gives the layer its own weight.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.CheckPositive('input_dims', 'output_dims')
    self._act = Activation(p.activation)
    # A function, not an attribute Keras would track as this layer's own.
    self._tied_table = None
    self.w = (None if p.tied_embedding else
              self.CreateVariable('w', (p.input_dims, p.output_dims)))
    self.b = (self.CreateVariable('b', (p.output_dims,), 'zeros')
              if p.has_bias else None)

  @property
  def is_bound(self):
    """False while a tied layer has not been given its embedding table."""
    return not self.p.tied_embedding or self._tied_table is not None

  def BindTiedEmbedding(self, layer):
    """Makes `layer`'s table (an EmbeddingLayer's `emb`) this layer's weight."""
    p = self.p
    table = getattr(layer, 'emb', None)
    want = (p.output_dims, p.input_dims)
    if table is None or tuple(table.shape) != want:
      raise ValueError(
          f'{p.name}: tied_embedding={p.tied_embedding!r} must name an '
          f'EmbeddingLayer with a table of shape {want} (vocab_size='
          f'output_dims, embedding_dim=input_dims). Received: layer '
          f'{layer.name!r} ({type(layer).__name__}) with '
          f'{None if table is None else tuple(table.shape)}')
    self._tied_table = lambda: layer.emb

  def FProp(self, inputs):
    p = self.p
    if not self.is_bound:
      raise ValueError(
          f'{p.name}: tied_embedding={p.tied_embedding!r} names no layer of '
          'the network; put the EmbeddingLayer of that name in the same '
          'SequentialLayer or pipeline.')
    weight = self.w if self._tied_table is None else self._tied_table()
    transpose = self._tied_table is not None
    # A 2-D matmul, not einsum('...i,io->...o'): that einsum's weight gradient
    # materialises a [batch, in, out] tensor (1000x the activations' memory).
    if inputs.shape.rank == 2:
      out = tf.matmul(inputs, weight, transpose_b=transpose)
    else:
      flat = tf.reshape(inputs, [-1, p.input_dims])
      out = tf.reshape(tf.matmul(flat, weight, transpose_b=transpose),
                       tf.concat([tf.shape(inputs)[:-1], [p.output_dims]],
                                 axis=0))
    if self.b is not None:
      out += self.b
    return self._act(out)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    out_shape = tuple(input_shape[:-1]) + (p.output_dims,)
    rows = NumPositions(input_shape)
    flops = 2.0 * rows * p.input_dims * p.output_dims
    if p.has_bias:
      flops += rows * p.output_dims
    return base_layer.CostMeta(
        output_shape=out_shape,
        flops=flops,
        num_params=(0 if p.tied_embedding else p.input_dims * p.output_dims) +
        (p.output_dims if p.has_bias else 0),
        activation_bytes=OutputBytes(out_shape, p.dtype))


def BindTiedEmbeddings(layers):
  """Binds each tied FCLayer among `layers` (and their sublayers) to its table.

  A tie whose embedding is not among them is left for an enclosing
  container: a SequentialLayer inside a pipeline's cell leaves it to the
  pipeline, which holds every cell.

  Returns:
    The tied FCLayers that are still unbound.
  """
  flat = [sub for layer in layers
          for sub in layer._flatten_layers(include_self=True)]  # pylint: disable=protected-access
  tables = {}
  for sub in flat:
    if getattr(sub, 'emb', None) is not None:
      tables.setdefault(sub.name, []).append(sub)
  unbound = []
  for sub in flat:
    if not isinstance(sub, FCLayer) or sub.is_bound:
      continue
    found = tables.get(sub.p.tied_embedding, [])
    if len(found) > 1:
      raise ValueError(
          f'{sub.p.name}: tied_embedding={sub.p.tied_embedding!r} names '
          f'{len(found)} layers; give the EmbeddingLayer a unique name.')
    if found:
      sub.BindTiedEmbedding(found[0])
    else:
      unbound.append(sub)
  return unbound


class DropoutLayer(base_layer.BaseLayer):
  """Inverted dropout that a re-materialized forward pass repeats exactly.

  Inside a pipeline step the mask is `base_layer.StepKeepMask`: a function of
  the step, the layer's SeedPath and, when the engine passes the
  micro-batch's example offset, of each example's index in the whole batch.
  So `tf.recompute_grad` recomputes the same mask, and the masks (and so the
  loss curve) do not depend on the number of partitions or micro-batches.
  Axis 0 of the input must be the batch. Outside a pipeline a Keras seed
  generator is used, which advances on every call as usual.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('keep_prob', 1.0, 'Probability of keeping each element.')
    return p

  def __init__(self, params):
    super().__init__(params)
    if not 0.0 < self.p.keep_prob <= 1.0:
      raise ValueError(f'{self.p.name}: keep_prob must be in (0, 1].')
    self._seed_generator = None
    if self.p.keep_prob < 1.0:
      self._seed_generator = keras.random.SeedGenerator(
          seed=self.p.random_seed, name='seed_generator')

  def FProp(self, inputs, training=None):
    keep_prob = self.p.keep_prob
    if not training or keep_prob >= 1.0:
      return inputs
    mask = base_layer.StepKeepMask(tf.shape(inputs), keep_prob,
                                   self.SeedSalt())
    if mask is None:
      return keras.random.dropout(
          inputs, rate=1.0 - keep_prob, seed=self._seed_generator)
    return tf.where(mask, inputs / keep_prob, tf.zeros_like(inputs))

  @classmethod
  def FPropMeta(cls, p, input_shape):
    return base_layer.CostMeta(
        output_shape=tuple(input_shape),
        flops=2.0 * Elements(input_shape),
        num_params=0,
        activation_bytes=OutputBytes(input_shape, p.dtype))


class SequentialLayer(base_layer.BaseLayer):
  """Runs the layers of `p.sub` one after another.

  This is the container the GPipe partitioner flattens and cuts into cells,
  and the engine's cell class subclasses it, so it keeps the contract
  simple: children are `self.sub`, built in order by `build` (so wrapped
  Keras layers get their variables under the device scope active at build
  time), and the cost is the sum of the children's chained costs.
  """

  # Cells are SequentialLayers and differ with K: not part of a child's seed.
  NAMES_CHILD_SEEDS = False

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sub', [], 'Params of the layers to run, in order.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChildren('sub', self.p.sub)
    BindTiedEmbeddings(self.sub)

  def build(self, input_shape):
    shape = input_shape
    for child in self.sub:
      if not child.built:
        child.build(shape)
      shape = child.compute_output_shape(shape)

  def FProp(self, inputs, training=None):
    outputs = inputs
    for child in self.sub:
      outputs = child(outputs, training=training)
    return outputs

  def compute_output_shape(self, input_shape):
    shape = input_shape
    for child in self.sub:
      shape = child.compute_output_shape(shape)
    return shape

  @classmethod
  def FPropMeta(cls, p, input_shape):
    costs = []
    shape = input_shape
    for i, sub in enumerate(p.sub):
      if not sub.name:
        sub = sub.Copy().Set(name=f'sub_{i}')
      cost = sub.target_cls.FPropMeta(sub, shape)
      costs.append(cost)
      shape = cost.output_shape
    if not costs:
      return base_layer.CostMeta(output_shape=tuple(input_shape))
    return base_layer.SumCosts(costs)
