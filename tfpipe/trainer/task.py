"""BaseTask: a pipelined model, its loss and its optimizer, built from params.

The task is where the pieces meet: the model builder (models/) gives a list
of layer params; the task seeds them, cuts them into cells with
`gpipe.PartitionSequentialLayers` and wraps the cells in a
`gpipe.PipeliningLayer`. A training step is ONE synchronous optimizer update
per mini-batch: the pipeline accumulates the micro-batches' gradients into
the exact full-batch gradient, which the task clips and applies. So the loss
curve does not depend on the number of partitions or micro-batches, only on
the seed, which is what the K=1 vs K=4 test checks.
"""

import keras
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import gpipe
from tfpipe import hyperparams
from tfpipe import initial_values
from tfpipe import placement
from tfpipe.gpipe import partition
from tfpipe.gpipe import loss as loss_lib
from tfpipe.trainer import optimizer as optimizer_lib


def TrainParams():
  """Params of the training loop and the optimizer."""
  p = hyperparams.Params()
  p.Define('learning_rate', 1e-3, 'Peak learning rate, scaled by lr_schedule.')
  p.Define('optimizer', optimizer_lib.OptimizerParams(),
           'Which optimizer and its settings.')
  p.Define('lr_schedule', optimizer_lib.LearningRateScheduleParams(),
           'Warmup and decay of the learning rate.')
  p.Define('clip_gradient_norm', 1.0,
           'Clip gradients to this global norm; 0 disables clipping.')
  p.Define('max_steps', 1000, 'Number of optimizer steps to train for.')
  p.Define('save_interval_steps', 100, 'Save a checkpoint every this many steps.')
  p.Define('max_checkpoints_to_keep', 3, 'Number of recent checkpoints kept.')
  p.Define('timeline_step', 0,
           'Record one training step\'s per-device timeline at this step into '
           'the logdir (timeline.txt/.json/.png); 0 records none.')
  p.Define('log_interval_steps', 50,
           'Print a progress line and write summaries every this many steps.')
  return p


def EvalParams():
  """Params of periodic and final evaluation."""
  p = hyperparams.Params()
  p.Define('interval_steps', 0,
           'Evaluate every this many training steps; 0 evaluates only at the '
           'end.')
  p.Define('num_batches', 4, 'Number of eval batches each evaluation averages.')
  return p


def SharesDevices(pipeline_p):
  """True if the pipeline places cells round-robin on fewer devices."""
  return bool(pipeline_p.round_robin_placement or
              pipeline_p.schedule == 'interleaved_1f1b')


def PipelineDevices(pipeline_p, prefix='task.pipeline'):
  """The R*K devices of the pipeline `pipeline_p` describes, checked.

  The pipeline's own device resolution (gpipe.ResolveDevices) decides; local
  device names are shortened ('/CPU:0') for tables and messages.

  Raises:
    ValueError: saying how to get enough devices.
  """
  needed = pipeline_p.num_partitions * pipeline_p.num_replicas
  try:
    devices = gpipe.ResolveDevices(pipeline_p.devices, needed,
                                   SharesDevices(pipeline_p))
  except ValueError as e:
    raise ValueError(
        f'{prefix}: num_partitions x num_replicas = {needed} devices: {e} '
        'The trainer\'s --num_devices splits the CPU or the GPUs into that '
        'many logical devices.') from None
  return ['/' + d[len('/device:'):] if d.startswith('/device:') else d
          for d in devices]


def SeededLayerParams(model, random_seed):
  """The model's layers with distinct initializer seeds derived from `random_seed`.

  Seeds depend only on the layer's position in the list, so the initial
  weights are the same however the list is partitioned.
  """
  result = []
  base = (random_seed % 10000) * 100000
  for i, lp in enumerate(model.LayerParamsList()):
    lp = lp.Copy()
    if 'random_seed' in lp and lp.random_seed is None:
      lp.random_seed = base + 100 * i
    result.append(lp)
  return result


def PartitionCells(task_p, model):
  """The K cell params of the pipeline that `task_p` describes."""
  pp = task_p.pipeline
  balance = list(pp.balance) if isinstance(pp.balance,
                                           (list, tuple)) else pp.balance
  return gpipe.PartitionSequentialLayers(
      SeededLayerParams(model, task_p.random_seed),
      num_partitions=pp.num_partitions, balance=balance,
      input_shape=model.InputShape(), input_dtype=model.InputDtype())


def DescribeCells(cell_params, devices, input_shape):
  """Per cell: name, device, layer names, params, forward flops, output.

  Args:
    cell_params: the cells' params, from PartitionCells.
    devices: the cells' devices.
    input_shape: the pipeline's input shape, batch dim included.

  Returns:
    A list of dicts, one per cell.
  """
  # One chain over all layers: equal blocks are costed once (LayerCosts).
  metas = partition.LayerCosts([lp for cell in cell_params for lp in cell.sub],
                               tuple(input_shape))
  rows = []
  start = 0
  for k, cell in enumerate(cell_params):
    cell_metas = metas[start:start + len(cell.sub)]
    start += len(cell.sub)
    total = base_layer.SumCosts(cell_metas)
    rows.append({'cell': cell.name, 'device': devices[k],
                 'layers': [lp.name for lp in cell.sub],
                 'params': total.num_params, 'flops': total.flops,
                 'output_bytes': (cell_metas[-1].activation_bytes
                                  if cell_metas else 0),
                 'output_shape': (cell_metas[-1].output_shape if cell_metas
                                  else tuple(input_shape))})
  return rows


class BaseTask:
  """Builds the pipeline and optimizer; runs train and eval steps."""

  # Set by the trainer (--nan_policy=skip) before the first step: an update
  # whose loss or gradient norm is not finite is skipped inside the step.
  skip_non_finite_updates = False

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', 'task', 'Name of the task, used in messages.')
    p.Define('model', None,
             'Params of the model builder (models/), which gives the layer '
             'list and the loss.')
    p.Define('random_seed', 1234,
             'Seed of the initial weights and of the per-step dropout masks.')
    p.Define('pipeline', gpipe.PipeliningLayer.Params().Set(
        name='pipe', num_partitions=1),
             'How the model is pipelined: the PipeliningLayer params the '
             'task builds, with cell_tpl cut from the model into '
             'num_partitions cells.')
    p.Define('train', TrainParams(), 'The training loop and optimizer.')
    p.Define('eval', EvalParams(), 'Evaluation during and after training.')
    return p

  @classmethod
  def CheckParams(cls, p, batch_sizes=None, prefix='task'):
    """Raises ValueError naming the bad param before anything is built.

    Args:
      p: task params.
      batch_sizes: {param name: batch size} of the inputs the task will see.
      prefix: how the task params are named in messages.
    """
    if p.model is None:
      raise ValueError(f'{prefix}.model is not set; set it to a model '
                       'builder\'s params, e.g. TransformerLm.Params().')
    pp = p.pipeline
    gpipe.PipeliningLayer.CheckParams(pp, prefix + '.pipeline')
    if pp.num_partitions is None:
      raise ValueError(f'{prefix}.pipeline.num_partitions is None; the task '
                       'cuts the model into that many cells (--num_partitions).')
    for name, batch_size in (batch_sizes or {}).items():
      if batch_size < pp.num_micro_batches:
        raise ValueError(
            f'{name}={batch_size} is smaller than {prefix}.pipeline.'
            f'num_micro_batches={pp.num_micro_batches}: every micro-batch '
            f'needs an example. Raise {name} or lower --num_micro_batches.')
    tp = p.train
    optimizer_lib.CheckParams(tp.optimizer, tp.lr_schedule, prefix + '.train')
    for name in ('max_steps', 'save_interval_steps', 'log_interval_steps',
                 'max_checkpoints_to_keep'):
      if getattr(tp, name) < 1:
        raise ValueError(f'{prefix}.train.{name} must be >= 1; received '
                         f'{getattr(tp, name)}.')

  def __init__(self, params):
    self._params = params.Copy().Freeze()
    p = self.p
    self.CheckParams(p)
    self.model = p.model.Instantiate()
    self.devices = PipelineDevices(p.pipeline)
    keras.utils.set_random_seed(p.random_seed)
    self.cell_params = PartitionCells(p, self.model)
    with tf.device('/CPU:0'):
      self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name='global_step')
    self.pipe = p.pipeline.Copy().Set(
        cell_tpl=self.cell_params, devices=self.devices).Instantiate()
    self._BuildPipe()
    tp = p.train
    self.learning_rate_schedule = optimizer_lib.WarmupDecaySchedule(
        tp.learning_rate, tp.lr_schedule)
    self.optimizer = optimizer_lib.BuildOptimizer(
        tp.optimizer, self.learning_rate_schedule)
    # Slots exist before a checkpoint restore, so they are restored too. On
    # a worker's device, their zeros are made here (initial_values).
    with initial_values.ComputedHere():
      self.optimizer.build(self.pipe.trainable_variables)
    self._apply_step = tf.function(self._ApplyGradients)
    self._eval_step = tf.function(self._EvalStep)

  @property
  def p(self):
    return self._params

  def _BuildPipe(self):
    shape = self.model.InputShape()
    if not self.pipe.built:
      self.pipe.build(shape)

  def BatchSplitChangesTraining(self):
    """True if how a batch is split (M, micro-batch size, replicas) changes
    training: a layer normalizes each micro-batch with its own statistics.

    Such layers are the ones that defer their statistics to the pipeline
    (`ApplyDeferredStats`: batch norm), or Keras' BatchNormalization.
    """
    return any(
        hasattr(layer, 'ApplyDeferredStats') or
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in self.pipe._flatten_layers())  # pylint: disable=protected-access

  def CheckpointObjects(self):
    """What a checkpoint saves: step, model variables and optimizer slots."""
    return {'global_step': self.global_step, 'model': self.pipe,
            'optimizer': self.optimizer}

  # ---- steps --------------------------------------------------------------

  def _ComputeLossAndGradients(self, inputs, targets):
    return self.pipe.ComputeLossAndGradients(
        inputs, targets, self.model.Loss, training=True,
        step=self.global_step)

  def _ApplyGradients(self, loss, gradients, metrics):
    variables = self.pipe.trainable_variables
    # Each variable's clip and update run on its cell's device, not on the
    # default device (which would pull the whole model onto GPU:0).
    placement.FollowInputDevicesToTheEnd()
    with placement.FollowInputDevices():
      # A variable that no loss reaches has no gradient (None): the Keras
      # optimizer skips it, so its momentum and weight decay leave it alone.
      grads = placement.OnVariableDevices(gradients, variables)
      grad_norm = tf.linalg.global_norm(grads)
      lr = self.learning_rate_schedule(self.optimizer.iterations)

      def Apply():
        # Clipped by global norm, each gradient just before its update.
        with placement.NoSingleReplicaAllReduce(self.optimizer):
          optimizer_lib.ApplyGradients(
              self.optimizer, zip(grads, variables),
              clip_norm=self.p.train.clip_gradient_norm, norm=grad_norm,
              fused=self.p.train.optimizer.fused)
        return tf.constant(True)
      if self.skip_non_finite_updates:
        tf.cond(tf.math.is_finite(loss) & tf.math.is_finite(grad_norm), Apply,
                lambda: tf.constant(False))
      else:
        Apply()
    self.global_step.assign_add(1)
    result = {'loss': loss, 'grad_norm': grad_norm, 'learning_rate': lr}
    result.update(metrics)
    return result

  def TrainStep(self, batch):
    """One synchronous optimizer update on (inputs, targets); returns scalars.

    The pipeline runs its own step (traced, or from its device threads), and
    the update is traced separately: one code path for every executor.
    """
    inputs, targets = batch
    out = self._ComputeLossAndGradients(inputs, targets)
    return self._apply_step(out.loss, out.gradients, out.metrics)

  def _EvalStep(self, inputs, targets):
    outputs = self.pipe(inputs, training=False)
    with tf.device(self.pipe.cell_devices[-1]):
      # The whole batch at once: a mean is the mean, a (sum, weight) pair
      # is divided here, as the pipeline divides it in training.
      parts = loss_lib.ParseLoss(
          self.model.Loss(outputs, targets), 1.0,
          loss_lib.BatchSize(outputs, self.pipe.p.batch_dim))
      scale = 1.0 / parts.weight if parts.is_sum else 1.0
      result = {'loss': parts.numerator * scale}
      result.update({name: value * scale
                     for name, value in parts.metrics.items()})
    return result

  def EvalStep(self, batch):
    """Eval metrics of one (inputs, targets) batch, from a plain forward pass."""
    inputs, targets = batch
    return self._eval_step(inputs, targets)

  def Evaluate(self, dataset, num_batches):
    """Means of the eval metrics over the first `num_batches` of `dataset`."""
    totals = {}
    count = 0
    for batch in dataset.take(num_batches):
      for name, value in self.EvalStep(batch).items():
        totals[name] = totals.get(name, 0.0) + float(value)
      count += 1
    return {name: total / max(count, 1) for name, total in totals.items()}
