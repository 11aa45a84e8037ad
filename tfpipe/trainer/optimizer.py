"""Optimizers, learning-rate schedules and gradient clipping, all from params.

The trainer applies one synchronous update per mini-batch from the pipeline's
accumulated gradients, so the optimizer is an ordinary Keras optimizer; this
module only turns documented params into one, so every knob shows up in
`params.txt` and can be overridden with `--model_params_override`.

The learning rate is `learning_rate * warmup(step) * decay(step)`, with a
linear warmup over `warmup_steps` and then a constant, cosine, exponential or
inverse-square-root decay. `step` is the 0-based optimizer step.
"""

import math

import keras
import tensorflow as tf

from tfpipe import hyperparams

OPTIMIZERS = ('adam', 'sgd', 'rmsprop')
DECAYS = ('constant', 'cosine', 'exponential', 'inverse_sqrt')


def OptimizerParams():
  """Params choosing and configuring the Keras optimizer."""
  p = hyperparams.Params()
  p.Define('type', 'adam', 'Optimizer: adam, sgd (with momentum) or rmsprop.')
  p.Define('beta1', 0.9, 'Adam: decay rate of the first-moment estimate.')
  p.Define('beta2', 0.999, 'Adam: decay rate of the second-moment estimate.')
  p.Define('epsilon', 1e-7, 'Adam and RMSProp: constant added for stability.')
  p.Define('momentum', 0.9, 'SGD and RMSProp: momentum coefficient.')
  p.Define('nesterov', False, 'SGD: whether to use Nesterov momentum.')
  p.Define('rho', 0.9, 'RMSProp: decay rate of the squared-gradient average.')
  return p


def LearningRateScheduleParams():
  """Params of the warmup-then-decay learning-rate schedule."""
  p = hyperparams.Params()
  p.Define('warmup_steps', 0, 'Steps of linear warmup from lr/warmup to lr.')
  p.Define('decay', 'constant',
           'Decay after warmup: constant, cosine, exponential or inverse_sqrt.')
  p.Define('decay_steps', 1000,
           'Cosine: steps to reach the minimum; exponential: steps per '
           'decay_rate factor.')
  p.Define('decay_rate', 0.5, 'Exponential: factor applied every decay_steps.')
  p.Define('min_ratio', 0.0,
           'Floor of the decay factor as a fraction of learning_rate.')
  return p


def _Check(p, prefix):
  if p.decay not in DECAYS:
    raise ValueError(f'{prefix}.decay={p.decay!r}; use one of {DECAYS}.')
  if p.warmup_steps < 0:
    raise ValueError(f'{prefix}.warmup_steps must be >= 0.')
  if p.decay in ('cosine', 'exponential') and p.decay_steps <= 0:
    raise ValueError(f'{prefix}.decay_steps must be > 0 for {p.decay} decay.')


class WarmupDecaySchedule(keras.optimizers.schedules.LearningRateSchedule):
  """`learning_rate * min(1, (step+1)/warmup_steps) * decay(step - warmup_steps)`."""

  def __init__(self, learning_rate, params,
               prefix='task.train.lr_schedule'):
    super().__init__()
    _Check(params, prefix)
    self.learning_rate = float(learning_rate)
    self.params = params.Copy().Freeze()

  def __call__(self, step):
    p = self.params
    step = tf.cast(step, tf.float32)
    warmup = float(p.warmup_steps)
    factor = tf.constant(1.0)
    if p.warmup_steps > 0:
      factor = tf.minimum(1.0, (step + 1.0) / warmup)
    after = tf.maximum(step - warmup, 0.0)
    if p.decay == 'cosine':
      frac = tf.minimum(after / float(p.decay_steps), 1.0)
      decay = p.min_ratio + (1.0 - p.min_ratio) * 0.5 * (
          1.0 + tf.cos(math.pi * frac))
    elif p.decay == 'exponential':
      decay = tf.maximum(
          tf.pow(float(p.decay_rate), after / float(p.decay_steps)),
          p.min_ratio)
    elif p.decay == 'inverse_sqrt':
      decay = tf.maximum(
          tf.sqrt(max(warmup, 1.0) / tf.maximum(step + 1.0, max(warmup, 1.0))),
          p.min_ratio)
    else:
      decay = tf.constant(1.0)
    return self.learning_rate * factor * decay

  def get_config(self):
    return {'learning_rate': self.learning_rate,
            'params': self.params.ToText()}


def BuildOptimizer(p, learning_rate, prefix='task.train.optimizer'):
  """A Keras optimizer from `OptimizerParams` and a learning rate or schedule."""
  if p.type == 'adam':
    return keras.optimizers.Adam(learning_rate=learning_rate, beta_1=p.beta1,
                                 beta_2=p.beta2, epsilon=p.epsilon)
  if p.type == 'sgd':
    return keras.optimizers.SGD(learning_rate=learning_rate,
                                momentum=p.momentum, nesterov=p.nesterov)
  if p.type == 'rmsprop':
    return keras.optimizers.RMSprop(learning_rate=learning_rate, rho=p.rho,
                                    momentum=p.momentum, epsilon=p.epsilon)
  raise ValueError(f'{prefix}.type={p.type!r}; use one of {OPTIMIZERS}.')


def CheckParams(optimizer_p, schedule_p, prefix='task.train'):
  """Raises ValueError naming the bad param, before anything is built."""
  if optimizer_p.type not in OPTIMIZERS:
    raise ValueError(f'{prefix}.optimizer.type={optimizer_p.type!r}; use one '
                     f'of {OPTIMIZERS}.')
  _Check(schedule_p, prefix + '.lr_schedule')


def ClipGradients(gradients, clip_norm):
  """Global-norm clipping; returns (clipped gradients, norm before clipping).

  `clip_norm <= 0` disables clipping but still reports the norm.
  """
  norm = tf.linalg.global_norm(gradients)
  if clip_norm and clip_norm > 0:
    gradients, _ = tf.clip_by_global_norm(gradients, clip_norm,
                                          use_norm=norm)
  return gradients, norm


def ApplyGradients(optimizer, grads_and_vars, clip_norm=0.0, norm=None):
  """Clips by global norm and applies `optimizer`, each device's variables
  updated one after another; returns the norm before clipping.

  TensorFlow runs independent ops at the same time, so the per-variable
  updates of one device overlapped by as many as it has inter-op threads,
  and their temporaries (Adam's are several tensors the size of the
  variable) added up differently from one step to the next, by whole
  layers: no memory budget could be planned for that. One variable after
  another, each gradient clipped just before its variable's update, a
  device's update peaks at its largest variable's working set, every step.
  The memory profiles (gpipe/memory_profile.py) update the same way.

  Args:
    optimizer: a Keras optimizer.
    grads_and_vars: (gradient, variable) pairs.
    clip_norm: clip to this global norm (ClipGradients); <= 0: no clipping.
    norm: the gradients' global norm, if already computed.
  """
  grads_and_vars = list(grads_and_vars)
  if norm is None:
    norm = tf.linalg.global_norm([g for g, _ in grads_and_vars])
  scale = None
  if clip_norm and clip_norm > 0:
    # As tf.clip_by_global_norm: NaN when the norm is not finite.
    scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm)
    scale = tf.where(tf.math.is_finite(norm), scale, float('nan'))
  if tf.executing_eagerly() or not callable(
      getattr(optimizer, 'update_step', None)):
    if scale is not None:
      grads_and_vars = [(_Scaled(g, scale), v) for g, v in grads_and_vars]
    optimizer.apply_gradients(grads_and_vars)
    return norm
  update_step = optimizer.update_step
  last = {}  # device -> the ops that end its previous variable's update

  def UpdateStep(gradient, variable, learning_rate):
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    device = getattr(variable, 'device', '')
    with tf.control_dependencies(last.get(device, [])):
      if scale is not None:
        gradient = _Scaled(gradient, scale)
      result = update_step(gradient, variable, learning_rate)
    ends = _LastOps(graph.get_operations()[first:])
    if ends:
      last[device] = ends
    return result

  own = vars(optimizer).get('update_step')  # Set on the instance, if any.
  optimizer.update_step = UpdateStep
  try:
    optimizer.apply_gradients(grads_and_vars)
  finally:
    if own is None:
      del optimizer.update_step  # The class's method again.
    else:
      optimizer.update_step = own
  return norm


@tf.autograph.experimental.do_not_convert
def _LastOps(ops):
  """The ops of `ops` that no other op of `ops` reads.

  Bookkeeping on Python objects, kept out of autograph: converted, it cost
  5 ms a variable (5 s of a 1000-variable update's trace).
  """
  made = set(ops)
  return [op for op in ops if not any(
      consumer in made for output in op.outputs
      for consumer in output.consumers())]


def _Scaled(gradient, scale):
  if gradient is None:
    return None
  if isinstance(gradient, tf.IndexedSlices):
    return tf.IndexedSlices(gradient.values * tf.cast(scale, gradient.dtype),
                            gradient.indices, gradient.dense_shape)
  return gradient * tf.cast(scale, gradient.dtype)
