"""Optimizers, learning-rate schedules and gradient clipping, all from params.

The trainer applies one synchronous update per mini-batch from the pipeline's
accumulated gradients, so the optimizer is an ordinary Keras optimizer; this
module only turns documented params into one, so every knob shows up in
`params.txt` and can be overridden with `--model_params_override`.

The learning rate is `learning_rate * warmup(step) * decay(step)`, with a
linear warmup over `warmup_steps` and then a constant, cosine, exponential or
inverse-square-root decay. `step` is the 0-based optimizer step.
"""

import functools
import math

import keras
import tensorflow as tf

from tfpipe import hyperparams
from tfpipe import placement

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
  p.Define('fused', True,
           'Adam and SGD update each variable with TensorFlow\'s fused '
           'kernel, which allocates no temporaries; False: Keras\' own '
           'ops (float32 Adam then matches Keras to the bit).')
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


@tf.autograph.experimental.do_not_convert
def ApplyGradients(optimizer, grads_and_vars, clip_norm=0.0, norm=None,
                   fused=True):
  """Clips by global norm and applies `optimizer`, each device's variables
  updated one after another; returns the norm before clipping.

  TensorFlow runs independent ops at the same time, so the per-variable
  updates of one device overlapped by as many as it has inter-op threads,
  and their temporaries (Adam's are several tensors the size of the
  variable) added up differently from one step to the next, by whole
  layers: no memory budget could be planned for that. One variable after
  another, each gradient clipped just before its variable's update, a
  device's update peaks at its largest variable's working set, every step.
  Adam and SGD run as TensorFlow's fused kernels (FusedUpdate), which
  allocate nothing but the clipped gradient. The memory profiles
  (gpipe/memory_profile.py) update the same way.

  Autograph is kept out (the update has no control flow on tensors):
  converting its per-variable Python (the optimizer's, the distribution's
  wrappers, the kernels') took longer than creating its ops.

  Args:
    optimizer: a Keras optimizer.
    grads_and_vars: (gradient, variable) pairs.
    clip_norm: clip to this global norm (ClipGradients); <= 0: no clipping.
    norm: the gradients' global norm, if already computed.
    fused: run Adam and SGD as TensorFlow's kernels (FusedUpdate); False:
      always the optimizer's own update_step.
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
  if not getattr(optimizer, 'built', True):
    # Built in the trace, its slots would go to the default device: Keras
    # colocates each with its variable only when built eagerly.
    with tf.init_scope():
      optimizer.build([v for _, v in grads_and_vars])
  update_step = optimizer.update_step
  fused = fused and FusedUpdate.For(optimizer)
  last = {}  # device -> the ops that end its previous variable's update

  def UpdateStep(gradient, variable, learning_rate):
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    device = getattr(variable, 'device', '')
    step = update_step
    if fused and fused.Applies(gradient, variable):
      step = fused.Kernel(variable, learning_rate)
    with tf.control_dependencies(last.get(device, [])):
      if scale is not None:
        gradient = _Scaled(gradient, scale)
      result = step(gradient, variable, learning_rate)
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


class FusedUpdate:
  """Keras' Adam and SGD updates as TensorFlow's fused kernels.

  Keras writes an update as a dozen element-wise ops per variable, after a
  dozen scalar ops (the step's powers of the betas, the learning rate's
  cast) that every variable repeats. TensorFlow's training kernels
  (ResourceApplyAdam, ResourceApplyKerasMomentum,
  ResourceApplyGradientDescent) compute the same formulas in one op that
  writes the variable and its slots in place. So an update allocates
  nothing the size of a variable (Keras' Adam allocates several, which a
  device's budget had to hold at its largest variable), runs one kernel
  per variable on an accelerator instead of a dozen, and traces about
  five times faster: a model of a few thousand variables spent minutes
  creating its update's ops. The scalars are computed once per dtype.

  Only where the formula is Keras' own: exactly keras.optimizers.Adam
  (without amsgrad) or SGD, not a subclass, which may change the update;
  dense gradients of a floating-point variable. Everything else (RMSprop,
  sparse gradients, other optimizers) keeps the optimizer's update_step.
  SGD's results, and Adam's in float64, are Keras' to within rounding (a
  few units in the last place). Adam's kernel computes its (1 - beta)
  factors in the variable's dtype, where Keras rounds them from Python's
  double. In float32, 1 - 0.999 is then 0.00099998713 against 0.001, so
  each step's change to a variable differs from Keras' by up to about 1e-5
  of itself; `fused=False` keeps Keras' ops.
  """

  _DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

  def __init__(self, optimizer):
    self.optimizer = optimizer
    self._scalars = {}  # (dtype, id(learning rate)) -> scalar tensors
    self._adam = isinstance(optimizer, keras.optimizers.Adam)
    if self._adam:
      self._kernel_name, self._slot_names = ('ResourceApplyAdam',
                                             ('_momentums', '_velocities'))
    elif optimizer.momentum != 0:
      self._kernel_name, self._slot_names = ('ResourceApplyKerasMomentum',
                                             ('momentums',))
    else:
      self._kernel_name, self._slot_names = 'ResourceApplyGradientDescent', ()

  @classmethod
  def For(cls, optimizer):
    """A FusedUpdate for `optimizer`, or None where its kernels do not apply."""
    kind = type(optimizer)
    if kind is keras.optimizers.Adam:
      if optimizer.amsgrad:
        return None
    elif kind is not keras.optimizers.SGD:
      return None
    if not hasattr(optimizer, '_get_variable_index'):
      return None
    return cls(optimizer)

  def Applies(self, gradient, variable):
    """Whether the kernel updates `variable`; asked in update_step, once the
    optimizer has built its slots."""
    opt = self.optimizer
    if not (isinstance(gradient, tf.Tensor) and
            tf.as_dtype(variable.dtype) in self._DTYPES and
            all(hasattr(opt, slot) for slot in self._slot_names)):
      return False
    # The kernel runs where its resources are, so they must be together,
    # on a device that has it for this dtype.
    device = placement.TfVariable(variable).device
    return (all(self._Slot(getattr(opt, slot), variable).device == device
                for slot in self._slot_names) and
            _HasKernel(self._kernel_name, device, variable.dtype))

  def Kernel(self, variable, learning_rate):
    """update_step's signature, run as the kernel; its scalars made now,
    outside the caller's control dependencies, so no device waits on
    another's update for them."""
    dtype = tf.as_dtype(variable.dtype)
    key = (dtype, id(learning_rate))
    if key not in self._scalars:
      self._scalars[key] = self._Scalars(dtype, learning_rate)
    scalars = self._scalars[key]
    if self._adam:
      return lambda g, v, unused_lr: self._Adam(g, v, **scalars)
    return lambda g, v, unused_lr: self._Sgd(g, v, **scalars)

  def _Scalars(self, dtype, learning_rate):
    opt = self.optimizer
    lr = tf.cast(learning_rate, dtype)
    if self._adam:
      # Rounded as Keras rounds them: its powers start from the betas cast
      # through float32, its (1 - beta) and epsilon from Python's floats.
      step = tf.cast(opt.iterations + 1, dtype)
      return dict(lr=lr, beta1=tf.constant(opt.beta_1, dtype),
                  beta2=tf.constant(opt.beta_2, dtype),
                  beta1_power=tf.pow(tf.cast(opt.beta_1, dtype), step),
                  beta2_power=tf.pow(tf.cast(opt.beta_2, dtype), step),
                  epsilon=tf.constant(opt.epsilon, dtype))
    return dict(lr=lr, momentum=tf.cast(opt.momentum, dtype))

  def _Slot(self, slots, variable):
    index = self.optimizer._get_variable_index(variable)  # pylint: disable=protected-access
    return placement.TfVariable(slots[index])

  def _Adam(self, gradient, variable, **scalars):
    opt = self.optimizer
    return tf.raw_ops.ResourceApplyAdam(
        var=placement.TfVariable(variable).handle,
        m=self._Slot(opt._momentums, variable).handle,  # pylint: disable=protected-access
        v=self._Slot(opt._velocities, variable).handle,  # pylint: disable=protected-access
        grad=tf.cast(gradient, variable.dtype), **scalars)

  def _Sgd(self, gradient, variable, lr, momentum):
    opt = self.optimizer
    gradient = tf.cast(gradient, variable.dtype)
    if opt.momentum == 0:
      return tf.raw_ops.ResourceApplyGradientDescent(
          var=placement.TfVariable(variable).handle, alpha=lr, delta=gradient)
    return tf.raw_ops.ResourceApplyKerasMomentum(
        var=placement.TfVariable(variable).handle,
        accum=self._Slot(opt.momentums, variable).handle, lr=lr,
        grad=gradient, momentum=momentum, use_nesterov=opt.nesterov)


def _HasKernel(op_name, device, dtype):
  """Whether TensorFlow has `op_name` for `dtype` on `device`'s type."""
  device_type = tf.DeviceSpec.from_string(device or '').device_type
  if not device_type:
    return True  # Unknown here; TensorFlow places it with its variable.
  return _KernelTypes(op_name, device_type) is None or (
      tf.as_dtype(dtype).as_datatype_enum in _KernelTypes(op_name,
                                                          device_type))


@functools.lru_cache(maxsize=None)
def _KernelTypes(op_name, device_type):
  """The dtypes (enums) of op_name's kernels on device_type; None: unknown."""
  try:
    from tensorflow.python.framework import kernels  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
    registered = kernels.get_registered_kernels_for_op(op_name).kernel
  except (ImportError, AttributeError):
    return None
  return frozenset(
      t for k in registered if k.device_type == device_type
      for c in k.constraint if c.name == 'T' for t in c.allowed_values.list.type)


def _LastOps(ops):
  """The ops of `ops` that no other op of `ops` reads."""
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
