"""pipeline(model): a Keras model trained through tfpipe's GPipe engine.

    pm = tfpipe.keras.pipeline(model, num_partitions=4, num_micro_batches=8)
    pm.compile(optimizer='adam', loss='sparse_categorical_crossentropy')
    pm.fit(dataset, epochs=3)

The functional graph is ordered and cut into cells (graph.py), each cell
becomes a `KerasCellLayer` cell holding references to the model's own layers
(cell.py), and the cells go to the same `gpipe.PipeliningLayer` as any
tfpipe model: micro-batching, schedules, re-materialization and deferred
batch norm are the engine's, not a second implementation.

`PipelinedModel` is a `keras.Model`, so compile/fit/evaluate/predict,
callbacks and checkpoints work. Its `train_step` runs one pipelined
forward+backward (`ComputeLossAndGradients`) with the compiled loss applied
per micro-batch on the last cell, and applies one optimizer update per
mini-batch. Its variables are the original model's (same objects, same
order), so whatever is trained through `pm` is in `model`, and weight files
written by `pm.save_weights` are the plain model's. A variable that several
cells read (a shared layer, tied embeddings, a closure) stays with its
first cell; the others read copies (gpipe/tied_variables.py).
"""

import inspect

import keras
import numpy as np
import tensorflow as tf

from tfpipe import initial_values
from tfpipe import placement
from tfpipe.gpipe import partition
from tfpipe.gpipe import pipelining_layer
from tfpipe.keras import batch_check
from tfpipe.keras import costs as costs_lib
from tfpipe.keras import graph as graph_lib
from tfpipe.keras import cell as cell_lib

_MEAN_REDUCTIONS = ('sum_over_batch_size', 'mean', 'mean_with_sample_weight')


def pipeline(model, num_partitions=4, num_micro_batches=8, devices=None,  # pylint: disable=invalid-name
             balance='time', remat_policy='always', schedule='gpipe',
             profile_batch_size=8, place_variables=True, executor='auto'):
  """Wraps a Sequential or functional Keras model into a pipelined model.

  Args:
    model: a built `keras.Sequential` or functional `keras.Model`.
    num_partitions: K, the number of cells (one device each).
    num_micro_batches: M, micro-batches per mini-batch.
    devices: one device per cell; None uses all GPUs, else all CPU devices.
    balance: 'time', 'flops', 'params', 'memory', or a list of K numbers of
      layer calls per cell (in the order `describe` prints).
    remat_policy: 'always', 'except_last' or 'never'.
    schedule: 'gpipe', '1f1b', 'interleaved_1f1b' (with fewer devices than
      partitions, placed round-robin) or 'zb_h1'.
    profile_batch_size: examples per profiled call for balance='time' (and
      the batch size the 'flops'/'memory' estimates assume).
    place_variables: move each cell's existing variables onto the cell's
      device (their values are kept). Keras creates variables where the model
      is built (GPU:0 on a GPU machine); the default puts them, and so their
      gradients and optimizer slots, where the cell runs. False leaves them
      where they are.
    executor: 'graph' (train_step is traced as usual), 'threads' (one
      thread per device, so cells overlap on CPU; `compile` then sets
      run_eagerly=True, since the pipeline dispatches its own traced
      functions) or 'auto', which is 'graph' here: Keras cells have no
      cost model to tell whether their actions are long enough for threads.

  Returns:
    A `PipelinedModel` sharing `model`'s layers and variables.
  """
  if not isinstance(num_partitions, int) or num_partitions < 1:
    raise ValueError('tfpipe.keras.pipeline: num_partitions must be an int '
                     f'>= 1. Received: num_partitions={num_partitions!r}')
  if not isinstance(model, keras.Model):
    raise ValueError('tfpipe.keras.pipeline: model must be a keras.Model '
                     f'(Sequential or functional). Received: {model!r}')
  graph = graph_lib.ModelGraph(model)
  graph_lib.CheckSupported(graph, remat_policy)
  n = len(graph.steps)
  if isinstance(balance, (list, tuple)):
    counts = [int(c) for c in balance]
    if len(counts) != num_partitions or min(counts) < 1 or sum(counts) != n:
      raise ValueError(
          f'tfpipe.keras.pipeline: an explicit balance lists the number of '
          f'layer calls of each of the num_partitions={num_partitions} '
          f'cells: positive numbers summing to {n}, the calls of model '
          f'{model.name!r}. Received: balance={list(balance)}')
    step_costs = costs_lib.StepCosts(graph, 'params')
  else:
    if n < num_partitions:
      raise graph_lib.TooFewStepsError(graph, num_partitions)
    step_costs = costs_lib.StepCosts(graph, balance, profile_batch_size)
    counts = partition.BlockPartition(step_costs, num_partitions)
  plans = graph_lib.PlanCells(graph, counts)
  return PipelinedModel(model, graph, plans, step_costs, balance,
                        num_micro_batches=num_micro_batches, devices=devices,
                        remat_policy=remat_policy, schedule=schedule,
                        place_variables=place_variables, executor=executor)


class PipelinedModel(keras.Model):
  """A keras.Model running another model's layers on a GPipe pipeline."""

  def __init__(self, model, graph, plans, step_costs, balance,
               num_micro_batches, devices, remat_policy, schedule,
               place_variables=True, executor='auto'):
    super().__init__(name=f'{model.name}_pipelined')
    # Tracked first, so self.weights lists the model's variables in its order.
    self.source_model = model
    self._graph = graph
    self._plans = plans
    self._balance = balance
    self._cell_costs = [
        sum(step_costs[s.index] for s in plan.steps) for plan in plans]
    cells = []
    for plan in plans:
      last = plan.index == len(plans) - 1
      cells.append(cell_lib.KerasCellLayer.Params().Set(
          name=f'cell{plan.index}', steps=plan.steps,
          input_keys=plan.input_keys, output_keys=plan.output_keys,
          outputs_struct=graph.outputs_struct if last else None,
          cell_index=plan.index))
    self.pipe = pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches,
        devices=devices, remat_policy=remat_policy, schedule=schedule,
        compile_step=False, executor=executor).Instantiate()
    self._compiled_step = None
    self._apply_step = None
    # The trainable variables the two functions above were traced for.
    self._traced_for = None
    # executor='threads' traces the last cell once per loss_fn object, so
    # the loss_fn for each batch size is kept.
    self._loss_fns = {}
    if place_variables:
      PlaceVariables(self.pipe)
    # Found now, from the model's input specs: describe() shows the ties, and
    # a cell that cannot run fails here rather than in the first step.
    self.pipe.TiedVariables({
        key: tf.TensorSpec(t.shape, t.dtype)
        for key, t in zip(graph.input_keys, graph.function.inputs)})
    self.output_names = list(getattr(model, 'output_names', []) or [])
    self.built = True

  @property
  def cell_plans(self):
    return list(self._plans)

  @property
  def cell_costs(self):
    return list(self._cell_costs)

  def _Feed(self, inputs):
    inputs = keras.tree.map_structure(tf.convert_to_tensor, inputs)
    flat = self._graph.function._standardize_inputs(inputs)  # pylint: disable=protected-access
    return dict(zip(self._graph.input_keys, flat))

  def call(self, inputs, training=None):
    return self.pipe(self._Feed(inputs), training=training)

  def _LossFn(self, batch_size):
    """The engine's loss_fn: compiled loss and metrics per micro-batch."""
    scale_sum = _UsesSumReduction(self.loss)

    def LossFn(y_pred, targets):
      y, sample_weight = targets if targets is not None else (None, None)
      n_m = tf.shape(keras.tree.flatten(y_pred)[0])[0]
      # A summed loss adds up over micro-batches; undo the n_m / N weight.
      sum_scale = tf.cast(batch_size, tf.float32) / tf.cast(
          n_m, tf.float32) if scale_sum else None
      loss = _CompileLossPerMicroBatch(self._compile_loss, y, y_pred,
                                       sample_weight, n_m, sum_scale)
      if self._compile_metrics is not None:
        self._compile_metrics.update_state(y, y_pred, sample_weight)
      if scale_sum:
        loss = loss * tf.cast(sum_scale, loss.dtype)
      return loss
    return LossFn

  def ComputeLossAndGradients(self, x, y=None, sample_weight=None,
                              training=True):
    """One pipelined forward+backward with the compiled loss and metrics.

    Returns:
      (loss, gradients): the exact mini-batch loss (plus weight
      regularization) and gradients aligned with `self.trainable_variables`
      (None for variables the model does not use).
    """
    if self._compile_loss is None:
      raise ValueError(
          f'{self.name}: compile the pipelined model with a loss before '
          "training, e.g. pm.compile(optimizer='adam', loss='mse').")
    feed = self._Feed(x)
    targets = None if y is None and sample_weight is None else (
        y, sample_weight)
    if tf.executing_eagerly() and not self.run_eagerly:
      # fit traces train_step itself; direct eager calls are compiled here
      # (compile(run_eagerly=True) keeps them eager, e.g. for debugging).
      self._ForgetStaleTraces()
      if self._compiled_step is None:
        self._compiled_step = tf.function(self._PipelineStep,
                                          reduce_retracing=True)
      result = self._compiled_step(feed, targets, training)
    else:
      result = self._PipelineStep(feed, targets, training)
    variables = self.trainable_variables
    position = {id(v): i for i, v in enumerate(variables)}
    grads = [None] * len(variables)
    for v, g in zip(self.pipe._CellVariables(), result.gradients):  # pylint: disable=protected-access
      grads[position[id(v)]] = g
    loss = result.loss
    regularized = [v for v in variables if v.regularizer is not None]
    if regularized:
      with tf.GradientTape() as tape:
        penalty = tf.add_n([v.regularizer(v) for v in regularized])
      for v, g in zip(regularized, tape.gradient(penalty, regularized)):
        i = position[id(v)]
        grads[i] = g if grads[i] is None else grads[i] + g
      loss = loss + tf.cast(penalty, loss.dtype)
    return loss, grads

  def compile(self, *args, **kwargs):  # pylint: disable=arguments-differ
    """keras.Model.compile; with executor='threads', run_eagerly is forced on.

    An optimizer that is already built (`load_model`'s, whose slots hold the
    saved state) was built for the variables before they were placed on the
    cells; this model gets a copy of it, built here, holding the same
    state.
    """
    arguments = _BoundArguments(keras.Model.compile, self, args, kwargs,
                                defaults=False)
    given = arguments.get('optimizer')
    if isinstance(given, keras.optimizers.Optimizer) and given.built:
      args, kwargs = (), dict(arguments)
      kwargs['optimizer'] = type(given).from_config(given.get_config())
    else:
      given = None
    if self.pipe.p.executor == 'threads':
      if kwargs.get('run_eagerly') is False:
        raise ValueError(
            f"{self.name}: executor='threads' dispatches its own traced "
            'functions from device threads, so train_step must run eagerly; '
            "drop run_eagerly=False or pipeline with executor='graph'.")
      kwargs['run_eagerly'] = True
    result = super().compile(*args, **kwargs)
    if self.optimizer is not None and not self.optimizer.built:
      # Built now, eagerly, each slot next to its variable. Built lazily
      # inside the traced train_step, the slots would be lifted out of the
      # trace without their colocation and land on the default device.
      # On a worker's device, their zeros are made here (initial_values).
      with initial_values.ComputedHere():
        self.optimizer.build(self.trainable_variables)
    if given is not None:
      _CopyOptimizerState(given, self.optimizer, self.name)
    return result

  def _PipelineStep(self, feed, targets, training):
    batch_size = tf.shape(keras.tree.flatten(feed)[0])[0]
    if tf.executing_eagerly():
      # Called eagerly, the cells trace once per loss_fn object: keep one
      # per batch size rather than a new closure per step.
      size = int(batch_size)
      if size not in self._loss_fns:
        self._loss_fns[size] = self._LossFn(size)
      loss_fn = self._loss_fns[size]
    else:
      loss_fn = self._LossFn(batch_size)
    return self.pipe.ComputeLossAndGradients(
        feed, targets, loss_fn, training=training)

  def train_step(self, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    loss, grads = self.ComputeLossAndGradients(x, y, sample_weight)
    batch_size = tf.shape(keras.tree.flatten(self._Feed(x))[0])[0]
    self._loss_tracker.update_state(loss, sample_weight=batch_size)
    used = tuple(i for i, g in enumerate(grads) if g is not None)
    if tf.executing_eagerly():
      # Eager ops without a device run on the default device (GPU:0); the
      # traced update places each variable's work on its cell's device.
      self._ForgetStaleTraces()
      if self._apply_step is None:
        self._apply_step = tf.function(self._ApplyGradients, autograph=False)
      self._apply_step([grads[i] for i in used], used)
    else:
      self._ApplyGradients([grads[i] for i in used], used)
    return self.get_metrics_result()

  def _ForgetStaleTraces(self):
    """Drops the traced step and update when the trainable set changed.

    A layer frozen (or unfrozen) between steps changes which gradients the
    step returns and which variables the update touches, but not the
    functions' input signatures, so they would not retrace by themselves.
    """
    key = tuple(id(v) for v in self.trainable_variables)
    if key != self._traced_for:
      self._traced_for = key
      self._compiled_step = None
      self._apply_step = None

  def _ApplyGradients(self, gradients, used):
    """The optimizer's update, each variable's part on that variable's device.

    Args:
      gradients: the gradients of the variables at positions `used` of
        self.trainable_variables (a tuple of ints).
    """
    variables = [self.trainable_variables[i] for i in used]
    with placement.FollowInputDevices():
      gradients = placement.OnVariableDevices(gradients, variables)
      with placement.NoSingleReplicaAllReduce(self.optimizer):
        self.optimizer.apply_gradients(zip(gradients, variables))

  def fit(self, *args, **kwargs):  # pylint: disable=signature-differs
    """keras.Model.fit; a batch smaller than num_micro_batches is refused
    before the first one trains (batch_check)."""
    return self._BatchChecked(keras.Model.fit, args, kwargs)

  def evaluate(self, *args, **kwargs):  # pylint: disable=signature-differs
    """keras.Model.evaluate, with fit's batch check."""
    return self._BatchChecked(keras.Model.evaluate, args, kwargs)

  def predict(self, *args, **kwargs):  # pylint: disable=signature-differs
    """keras.Model.predict, with fit's batch check."""
    return self._BatchChecked(keras.Model.predict, args, kwargs)

  def _BatchChecked(self, method, args, kwargs):
    """method(self, *args, **kwargs) once batch_check accepts its batches."""
    problem = batch_check.CallProblem(
        self.name, self.pipe.p.num_micro_batches, method.__name__,
        _BoundArguments(method, self, args, kwargs))
    if problem:
      raise ValueError(problem)
    with batch_check.ShortRuntimeErrors(self.name):
      return method(self, *args, **kwargs)

  def save_weights(self, filepath, overwrite=True, **kwargs):
    """Saves the original model's weights (loadable into the plain model)."""
    return self.source_model.save_weights(filepath, overwrite=overwrite,
                                          **kwargs)

  def load_weights(self, filepath, **kwargs):
    """Loads weights saved from the plain model (or by save_weights)."""
    return self.source_model.load_weights(filepath, **kwargs)

  def save(self, filepath, overwrite=True, **kwargs):
    """Saves the plain model, with this model's optimizer state and compile
    config once it is compiled.

    `keras.models.load_model` returns the plain model, compiled, to be
    pipelined again (`pipeline(loaded, ...)`, then `compile(optimizer=
    loaded.optimizer, loss=loaded.loss, ...)` to train on). To put them in
    the file, the plain model is compiled like this one, with the same
    optimizer object: the two share their variables, so the optimizer's
    slots and iteration count are the ones this model trained.
    """
    model = self.source_model
    if self.compiled:
      config = dict(self._compile_config.config)
      # How this model runs its steps is its own, not the plain model's.
      config.update(optimizer=self.optimizer, run_eagerly=None,
                    jit_compile='auto')
      model.compile(**config)
    return model.save(filepath, overwrite=overwrite, **kwargs)

  def summary(self, print_fn=None, **kwargs):
    """Prints each cell: layers, device, parameter count, estimated cost."""
    del kwargs
    (print_fn or print)(describe(self))


def _CopyOptimizerState(source, target, name):
  """Assigns the variables of optimizer `source` to those of `target`."""
  pairs = list(zip(source.variables, target.variables))
  if len(source.variables) != len(target.variables) or any(
      tuple(a.shape) != tuple(b.shape) for a, b in pairs):
    raise ValueError(
        f'{name}: the optimizer given to compile was built for other '
        f'variables ({len(source.variables)} optimizer variables; this model '
        f'needs {len(target.variables)}). Pass the optimizer of the model '
        'being pipelined (e.g. load_model(...).optimizer), or a new one.')
  for a, b in pairs:
    b.assign(a)


def _BoundArguments(method, model, args, kwargs, defaults=True):
  """{name: value} of a call of keras.Model `method` (but `self`), with the
  defaults of the arguments not given if `defaults`."""
  bound = inspect.signature(method).bind(model, *args, **kwargs)
  if defaults:
    bound.apply_defaults()
  return {k: v for k, v in bound.arguments.items() if k != 'self'}


def PlaceVariables(pipe):
  """Re-creates each cell's variables on the cell's device, keeping values.

  A variable of a layer shared by several cells stays with the first; the
  others read it through copies (gpipe/tied_variables.py).
  """
  placed = set()
  for cell, device in zip(pipe.cells, pipe.cell_devices):
    wanted = tf.DeviceSpec.from_string(device)
    for v in cell.weights:
      if id(v) in placed:
        continue
      placed.add(id(v))
      current = tf.DeviceSpec.from_string(v.value.device)
      if current.make_merged_spec(wanted) == current:
        continue  # Already on the cell's device.
      with tf.device(device):
        v._value = tf.Variable(  # pylint: disable=protected-access
            tf.identity(v.value), dtype=v.value.dtype, trainable=v.trainable,
            name=v.value.name.split(':')[0])


def _UsesSumReduction(loss):
  """True if the compiled losses sum (rather than average) over the batch."""
  reductions = {getattr(l, 'reduction', 'sum_over_batch_size')
                for l in keras.tree.flatten(loss) if l is not None}
  if 'sum' not in reductions:
    return False
  if reductions != {'sum'}:
    raise ValueError(
        'tfpipe.keras: the compiled losses mix reduction="sum" with '
        f'averaging reductions ({sorted(map(str, reductions))}), which cannot '
        'be weighted exactly per micro-batch. Use one kind of reduction.')
  return True


def _CompileLossPerMicroBatch(compile_loss, y, y_pred, sample_weight,
                              num_examples, sum_scale=None):
  """compile_loss on one micro-batch, its per-output loss trackers weighted right.

  With several outputs, Keras' CompileLoss tracks each output's loss
  (`o1_loss`, ...) in a Mean weighted by y_pred's STATIC batch dimension.
  In the pipeline's traced micro-batch functions that dimension is None, so
  every micro-batch counted once whatever its size (batch 10 at M=3 gave
  o1_loss 1.837 against 1.463). Here each tracker update is weighted by the
  micro-batch's real size, and a summed loss is scaled by N / n_m as the
  total is, so the trackers equal the plain model's.

  Args:
    compile_loss: the model's `_compile_loss` (a keras CompileLoss).
    y, y_pred, sample_weight: the micro-batch's targets, outputs, weights.
    num_examples: int32 scalar tensor, the micro-batch's size n_m.
    sum_scale: N / n_m for reduction='sum' losses, else None.

  Returns:
    compile_loss(y, y_pred, sample_weight).
  """
  if not compile_loss.built:
    # Build the trackers first, symbolically as keras' fit does, so that
    # their first update is redirected too.
    def Symbolic(t):
      return None if t is None else keras.KerasTensor(
          (None,) + tuple(t.shape[1:]), dtype=t.dtype)
    keras.src.backend.compute_output_spec(
        compile_loss, *keras.tree.map_structure(
            Symbolic, (y, y_pred, sample_weight)))
  originals = {}

  def Weighted(tracker):
    original = tracker.update_state

    def UpdateState(values, sample_weight=None):
      del sample_weight  # The static batch dimension (or None).
      if sum_scale is not None:
        values = values * tf.cast(sum_scale, values.dtype)
      return original(values, sample_weight=num_examples)
    return UpdateState
  for tracker in compile_loss.metrics:
    originals[tracker] = tracker.__dict__.get('update_state')
    tracker.__dict__['update_state'] = Weighted(tracker)
  try:
    return compile_loss(y, y_pred, sample_weight)
  finally:
    for tracker, original in originals.items():
      if original is None:
        del tracker.__dict__['update_state']
      else:
        tracker.__dict__['update_state'] = original


def describe(pm):  # pylint: disable=invalid-name
  """A table of the cells of a PipelinedModel: layers, device, params, cost."""
  if not isinstance(pm, PipelinedModel):
    raise ValueError('tfpipe.keras.describe expects the model returned by '
                     f'tfpipe.keras.pipeline. Received: {type(pm).__name__}')
  pipe = pm.pipe
  balance = pm._balance if isinstance(pm._balance, str) else 'explicit/params'  # pylint: disable=protected-access
  rows = [f'Pipelined model {pm.source_model.name!r}: {pipe.num_cells} '
          f'cells, num_micro_batches={pipe.p.num_micro_batches}, '
          f'schedule={pipe.p.schedule!r}, remat_policy='
          f'{pipe.p.remat_policy!r}, cost={balance!r}']
  total = sum(pm.cell_costs) or 1.0
  counted = set()
  for plan, cell, device, cost in zip(pm.cell_plans, pipe.cells,
                                      pipe.cell_devices, pm.cell_costs):
    own = [v for v in cell.trainable_variables if id(v) not in counted]
    counted.update(id(v) for v in own)
    params = int(sum(np.prod(v.shape) for v in own))
    names = [s.name for s in plan.steps]
    rows.append(
        f'cell {plan.index} on {device}: {len(names)} layer calls, '
        f'{params:,} params, cost {cost:.4g} ({100.0 * cost / total:.1f}%)')
    rows.append(f'  layers:   {names[0]} .. {names[-1]}' if len(names) > 6
                else f'  layers:   {", ".join(names)}')
    if len(names) > 6:
      rows.append(f'            ({", ".join(names)})')
    rows.append(f'  receives: {", ".join(plan.input_keys)}')
    rows.append(f'  sends:    {", ".join(plan.output_keys)}')
  rows.extend(pipe.TiedVariables().Describe(pipe.cell_devices))
  return '\n'.join(rows)
