"""Normalization layers: batch norm (pipeline-aware) and layer norm.

Batch norm is the one layer whose state depends on how a batch is split. In a
GPipe step the same layer runs once per micro-batch; updating the moving
averages each time would apply the decay M times to micro-batch statistics.
Instead, when the pipeline installs a `DeferredStatsCollector`, the layer
records each micro-batch's (mean, variance, count) and `ApplyDeferredStats`
merges them exactly into full-batch statistics and updates once, so the
moving averages after a pipelined step equal those of an unsplit step.

On images (4-D and 5-D inputs, channels last) batch norm is TensorFlow's
fused kernel: one op forward and one backward, where `tf.nn.moments` and
`tf.nn.batch_normalization` trace about twenty forward ops and their
gradients. A pipeline traces every cell's forward and backward before its
first step, so the op count is start-up time: AmoebaNet-D's first pipelined
step traced about 25% faster fused (benchmarks/RESULTS.md, largest_model).
"""

import tensorflow as tf

from tfpipe import base_layer
from tfpipe import deferred_stats
from tfpipe.layers import core


# The merge of micro-batches' moments (deferred_stats), named here too.
MergeMoments = deferred_stats.MergeMoments


class BatchNormLayer(base_layer.BaseLayer):
  """Batch normalization over all axes but the last."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 0, 'Size of the last (channel) dim.')
    p.Define('decay', 0.99, 'Moving-average momentum: weight of the old value.')
    p.Define('epsilon', 1e-3, 'Added to the variance to avoid dividing by 0.')
    p.Define('fused', True, 'Use TensorFlow\'s fused batch-norm kernel on '
             '4-D and 5-D inputs (the same statistics, fewer ops to trace '
             'and run); False always normalizes with separate ops.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.CheckPositive('dim')
    self.gamma = self.CreateVariable('gamma', (p.dim,), 'ones')
    self.beta = self.CreateVariable('beta', (p.dim,), 'zeros')
    self.moving_mean = self.CreateVariable(
        'moving_mean', (p.dim,), 'zeros', trainable=False)
    self.moving_variance = self.CreateVariable(
        'moving_variance', (p.dim,), 'ones', trainable=False)

  def FProp(self, inputs, training=None):
    if self._Fused(inputs):
      return self._FusedFProp(inputs, training)
    if training:
      axes = list(range(len(inputs.shape) - 1))
      mean, variance = tf.nn.moments(inputs, axes)
      self._Record(mean, variance, inputs)
    else:
      mean, variance = self.moving_mean, self.moving_variance
    return tf.nn.batch_normalization(inputs, mean, variance, self.beta,
                                     self.gamma, self.p.epsilon)

  def _Record(self, mean, variance, inputs, count=None):
    """Hands a training batch's statistics to the pipeline's collector, or
    updates the moving averages now when there is none."""
    collector = base_layer.CurrentStatsCollector()
    if collector is not None:
      if count is None:
        count = tf.cast(tf.reduce_prod(tf.shape(inputs)[:-1]), tf.float32)
      collector.Add(self, {'mean': mean, 'variance': variance}, count)
    else:
      self.ApplyMergedMoments(mean, variance)

  def _Fused(self, inputs):
    """Whether `inputs` take the fused kernel: images, channels last, in a
    dtype it normalizes (its statistics are float32), with more than one
    element per channel when that is known (a single element's variance is
    0, which the kernel's Bessel-corrected output would not give back)."""
    shape = inputs.shape
    if not self.p.fused or shape.rank not in (4, 5):
      return False
    if inputs.dtype not in (tf.float32, tf.float16, tf.bfloat16):
      return False
    if tf.as_dtype(self.gamma.dtype) != tf.float32:
      return False
    elements = shape[:-1].num_elements()
    return elements is None or elements > 1

  def _FusedFProp(self, inputs, training):
    data_format = 'NHWC' if inputs.shape.rank == 4 else 'NDHWC'
    # The kernel's statistics and scale are float32 whatever x's dtype (a
    # read under Keras' autocast may give them in x's).
    scale = tf.cast(self.gamma, tf.float32)
    offset = tf.cast(self.beta, tf.float32)
    if not training:
      return tf.raw_ops.FusedBatchNormV3(
          x=inputs, scale=scale, offset=offset,
          mean=tf.cast(self.moving_mean, tf.float32),
          variance=tf.cast(self.moving_variance, tf.float32),
          epsilon=self.p.epsilon, data_format=data_format,
          is_training=False).y
    empty = tf.constant([], tf.float32)
    result = tf.raw_ops.FusedBatchNormV3(
        x=inputs, scale=scale, offset=offset, mean=empty, variance=empty,
        epsilon=self.p.epsilon, exponential_avg_factor=1.0,
        data_format=data_format, is_training=True)
    # The kernel returns the variance Bessel-corrected (n / (n - 1)), for
    # moving averages; the merge of micro-batches (ApplyDeferredStats) and
    # the unfused path use the batch's own, as it normalized with.
    count = tf.cast(tf.reduce_prod(tf.shape(inputs)[:-1]), tf.float32)
    variance = tf.where(count > 1.0,
                        result.batch_variance * ((count - 1.0) / count),
                        tf.zeros_like(result.batch_variance))
    self._Record(result.batch_mean, variance, inputs, count)
    return result.y

  def ApplyDeferredStats(self, records):
    """Merges per-micro-batch statistics and updates the moving averages once.

    Args:
      records: list of (count, {'mean': m, 'variance': v}) as recorded by
        FProp, count being the float32 number of elements reduced per channel.

    Returns:
      The update op in graph mode, None when executing eagerly.
    """
    return self.ApplyMergedMoments(*MergeMoments(records))

  def ApplyMergedMoments(self, mean, variance):
    """Updates the moving averages once from the batch's (mean, variance);
    returns the update op in graph mode, None when executing eagerly."""
    decay = self.p.decay
    dtype = self.moving_mean.dtype
    mean = tf.cast(mean, dtype)
    variance = tf.cast(variance, dtype)
    return tf.group(
        self.moving_mean.value.assign(
            decay * self.moving_mean.value + (1.0 - decay) * mean),
        self.moving_variance.value.assign(
            decay * self.moving_variance.value + (1.0 - decay) * variance))

  @classmethod
  def FPropMeta(cls, p, input_shape):
    elements = core.Elements(input_shape)
    return base_layer.CostMeta(
        output_shape=tuple(input_shape),
        flops=8.0 * elements,
        num_params=2 * p.dim,
        activation_bytes=core.OutputBytes(input_shape, p.dtype))


class LayerNorm(base_layer.BaseLayer):
  """Layer normalization over the last dim, with learned scale and bias."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Size of the last dim, which is normalized.')
    p.Define('epsilon', 1e-6, 'Added to the variance to avoid dividing by 0.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.CheckPositive('input_dim')
    self.scale = self.CreateVariable('scale', (p.input_dim,), 'ones')
    self.bias = self.CreateVariable('bias', (p.input_dim,), 'zeros')

  def FProp(self, inputs):
    mean, variance = tf.nn.moments(inputs, [-1], keepdims=True)
    normed = (inputs - mean) * tf.math.rsqrt(variance + self.p.epsilon)
    return normed * self.scale + self.bias

  @classmethod
  def FPropMeta(cls, p, input_shape):
    elements = core.Elements(input_shape)
    return base_layer.CostMeta(
        output_shape=tuple(input_shape),
        flops=8.0 * elements,
        num_params=2 * p.input_dim,
        activation_bytes=core.OutputBytes(input_shape, p.dtype))
