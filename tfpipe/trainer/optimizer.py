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
