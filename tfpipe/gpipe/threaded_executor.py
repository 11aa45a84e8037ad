"""Runs a schedule with one Python thread per device and one traced function per cell.

Why a second executor: TensorFlow 2.21 runs the ops of one `tf.function` on
different logical CPU devices (and on gRPC workers) one after another, so the
graph executor's stages never overlap there: the bubble is 1 - 1/K whatever
M is. Separate function calls from separate threads do overlap: the runtime
releases the GIL while a function runs. Here each device gets a thread that
issues its actions in the schedule's order; every action is one call of a
`tf.function` of its cell, traced once per cell and input signature rather
than once per action, so tracing costs O(K) instead of O(K*M).

    F(m, k)  calls cell k's forward function; its output goes to the thread of
             cell k+1. Only the cell's input is kept (re-materialization).
    B(m, k)  calls cell k's backward function, which recomputes the forward
             under a GradientTape, takes the gradient of the output (seeded
             with the gradient from B(m, k+1)), adds the variables' gradients
             to per-variable buffers with assign_add, and returns the input's
             gradient for the thread of cell k-1.

A function cannot hand its tape to a later call, so every backward recomputes:
this executor requires remat_policy='always' (GPipe's default). Called inside
a tf.function there are no threads to run: the same cell functions are then
emitted into the one graph in the schedule's order, which keeps tracing O(K)
but leaves overlap to the runtime, as the graph executor does.

Random ops see the same per-(step, micro-batch) seed as in the graph executor,
so both executors give the same dropout masks. Deferred statistics (batch norm)
are returned by the forward functions and handed to the step's collector in
(micro-batch, cell) order, so the applied update does not depend on thread
timing.
"""

import concurrent.futures
import os
import threading
import time

import tensorflow as tf
from tensorflow.python.eager import context  # pylint: disable=g-direct-tensorflow-import

from tfpipe import base_layer
from tfpipe.gpipe import executor as executor_lib
from tfpipe.gpipe import schedule as schedule_lib

# Tracing runs Python layer code that keeps per-thread context (seeds,
# collectors), but Keras and tf.function also hold process-wide state while
# tracing; tracing one cell at a time keeps that simple and costs nothing
# after the first step.
_TRACE_LOCK = threading.RLock()


def _OnDevice(structure, device):
  """Copies a call's tensor arguments to `device` before the call.

  Then each cell function runs on one device only (its variables are there
  too): cheaper to dispatch, and runnable by the single-threaded executor,
  which hangs on functions that span devices.
  """
  canonical = tf.DeviceSpec.from_string(device)

  def Copy(t):
    if not isinstance(t, tf.Tensor):
      return t
    if canonical.make_merged_spec(tf.DeviceSpec.from_string(t.device)) == (
        tf.DeviceSpec.from_string(t.device)):
      return t  # Already there.
    return tf.identity(t)
  with tf.device(device):
    return tf.nest.map_structure(Copy, structure)


def _UseSingleThreadedExecutor():
  """Makes this thread's function calls run their ops one at a time, inline."""
  context.context().function_call_options.executor_type = (
      'SINGLE_THREADED_EXECUTOR')


def InterOpThreadsNeeded(num_devices):
  """Inter-op threads that serialize_device_ops needs for `num_devices`.

  A function call waits in an inter-op thread for its body, which the
  single-threaded executor runs in a second one; with fewer than two per
  concurrently calling device (plus one for eager work) the calls starve
  each other and the step hangs.
  """
  return 2 * num_devices + 1


def _CheckInterOpThreads(num_devices, name):
  threads = (tf.config.threading.get_inter_op_parallelism_threads() or
             os.cpu_count() or 1)
  needed = InterOpThreadsNeeded(num_devices)
  if threads < needed:
    raise ValueError(
        f'{name}: serialize_device_ops=True over {num_devices} devices needs '
        f'at least {needed} inter-op threads, but TensorFlow has {threads}. '
        'Call tf.config.threading.set_inter_op_parallelism_threads('
        f'{needed}) before TensorFlow starts, or set '
        'serialize_device_ops=False.')


def _SameDevice(a, b):
  a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
  return (a.device_type, a.device_index, a.task or 0, a.job or 'localhost') == (
      b.device_type, b.device_index, b.task or 0, b.job or 'localhost')


def _CheckVariablesOnCellDevices(cells, cell_devices, name):
  """The single-threaded executor hangs on functions that span devices.

  A cell whose variables live elsewhere (a data-parallel replica reading
  replica 0's variables, or Keras variables created before placement) makes
  its functions multi-device, whose parts would wait on each other forever.
  """
  for k, (cell, device) in enumerate(zip(cells, cell_devices)):
    for v in cell.variables:
      if not _SameDevice(v.value.device, device):
        raise ValueError(
            f'{name}: serialize_device_ops=True needs every variable of a '
            f'cell on that cell\'s device, but cell {k} ({cell.name}) runs on '
            f'{device} and its variable {v.path} lives on {v.value.device} '
            '(num_replicas > 1 reads replica 0\'s variables). Use '
            'num_replicas=1, or serialize_device_ops=False.')


class _Aborted(Exception):
  """Raised in a device thread when another thread has failed."""


class _Mailbox:
  """Hands tensors between device threads; a failure wakes every waiter."""

  def __init__(self):
    self._condition = threading.Condition()
    self._items = {}
    self._failed = False

  def Put(self, key, value):
    with self._condition:
      self._items[key] = value
      self._condition.notify_all()

  def Take(self, key):
    with self._condition:
      while key not in self._items:
        if self._failed:
          raise _Aborted()
        self._condition.wait()
      return self._items.pop(key)

  def Fail(self):
    with self._condition:
      self._failed = True
      self._condition.notify_all()


class _RecordingCollector(base_layer.DeferredStatsCollector):
  """Keeps a traced cell's deferred statistics so the function can return them."""

  def __init__(self):
    super().__init__()
    self.entries = []

  def Add(self, layer, stats, count):
    self.entries.append((layer, count, stats))


class _CellFunctions:
  """Cell k's forward and backward as tf.functions, traced once per signature.

  The last cell's forward also applies the loss and returns the loss's
  gradient with respect to the cell's output, so its backward is the same as
  every other cell's and loss_fn runs once per micro-batch (it may update
  metrics). Those functions are built per loss_fn.
  """

  def __init__(self, cell, device, is_first, training, accumulators,
               variable_offset, loss_fn=None):
    self._cell = cell
    self._device = device
    self._is_first = is_first
    self._training = training
    self._accumulators = accumulators
    self._offset = variable_offset
    self._loss_fn = loss_fn
    self.stat_layers = []
    # _noinline: inside an outer tf.function the calls stay calls, so the
    # outer graph holds K*M call ops rather than K*M inlined copies of the
    # cells for Grappler to optimize.
    options = dict(autograph=False, reduce_retracing=True,
                   experimental_attributes={'_noinline': True})
    self.forward = tf.function(
        self._Forward if loss_fn is None else self._ForwardLoss, **options)
    self.backward = tf.function(self._Backward, **options)

  def _Call(self, x, seed, collector, recomputing):
    with tf.device(self._device), base_layer.StepSeed(seed), (
        base_layer.CollectDeferredStats(collector)), (
            base_layer.Recomputing(recomputing)):
      return self._cell(x, training=self._training)

  def _Stats(self, collector):
    self.stat_layers = [layer for layer, _, _ in collector.entries]
    return [(count, stats) for _, count, stats in collector.entries]

  def _Loss(self, y, targets, weight, batch_size):
    with tf.device(self._device):
      loss, metrics = executor_lib.ParseLoss(self._loss_fn(y, targets))
      loss = executor_lib.Weighted(loss, weight, batch_size)
      metrics = {name: executor_lib.Weighted(value, weight, batch_size)
                 for name, value in metrics.items()}
    return loss, metrics

  def _Forward(self, x, seed):
    with _TRACE_LOCK, tf.device(self._device):
      collector = _RecordingCollector()
      y = self._Call(x, seed, collector, recomputing=False)
      return y, self._Stats(collector)

  def _ForwardLoss(self, x, targets, seed, weight, batch_size):
    """Returns (weighted loss, metrics, stats, d loss / d output)."""
    with _TRACE_LOCK, tf.device(self._device):
      collector = _RecordingCollector()
      y = self._Call(x, seed, collector, recomputing=False)
      y_float, rebuild = executor_lib.SplitFloat(y)
      with tf.GradientTape() as tape:
        tape.watch(y_float)
        loss, metrics = self._Loss(rebuild(y_float), targets, weight,
                                   batch_size)
      output_gradients = tape.gradient(
          loss, y_float, unconnected_gradients=tf.UnconnectedGradients.ZERO)
      return loss, metrics, self._Stats(collector), output_gradients

  def _Backward(self, x, output_gradients, seed, first):
    """Recomputes the cell, adds its variables' gradients; returns d(input)."""
    with _TRACE_LOCK, tf.device(self._device):
      return self._Gradients(x, list(output_gradients), seed, first)

  def _Gradients(self, x, output_gradients, seed, first):
    x_float, rebuild = executor_lib.SplitFloat(x)
    if self._is_first:
      x_float = []
    variables = list(self._cell.trainable_variables)
    with tf.GradientTape() as tape:
      tape.watch(x_float)
      y = self._Call(rebuild(x_float) if x_float else x, seed,
                     executor_lib.DiscardingCollector(), recomputing=True)
      target = executor_lib.SplitFloat(y)[0]
    grads = tape.gradient(target, list(x_float) + variables,
                          output_gradients=output_gradients,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    updates = [self._accumulators.Add(self._offset + i,
                                      executor_lib.AsDense(g), first)
               for i, g in enumerate(grads[len(x_float):])]
    with tf.control_dependencies(updates):
      # `done` lets a traced step order the device's next action after this
      # one even when there is no input gradient (cell 0).
      return [tf.identity(g) for g in grads[:len(x_float)]], tf.constant(True)


class ThreadedPipelineExecutor:
  """Runs forward+backward along a schedule from one thread per device."""

  def __init__(self, cells, cell_devices, schedule, name='pipe',
               serialize_device_ops=False, concurrent_devices=None):
    """Creates the executor and its device threads.

    Args:
      cells: the pipeline's cells, built on their devices.
      cell_devices: the device of each cell.
      schedule: a schedule_lib.Schedule over those cells.
      name: the pipeline's name, for messages.
      serialize_device_ops: run each function's ops one at a time on its
        device's thread (TensorFlow's single-threaded executor) instead of on
        the shared inter-op pool: each device then behaves like an
        accelerator that runs one op at a time.
      concurrent_devices: how many device threads may call functions at the
        same time, counting other executors stepped together (replicas);
        default: this schedule's devices.
    """
    self._cells = cells
    self._cell_devices = cell_devices
    self._schedule = schedule
    self._name = name
    schedule_lib.Validate(schedule)
    if serialize_device_ops:
      _CheckInterOpThreads(concurrent_devices or schedule.num_devices, name)
      _CheckVariablesOnCellDevices(cells, cell_devices, name)
    self._accumulators = None
    self._functions = {}
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=schedule.num_devices,
        thread_name_prefix=f'{name}-device',
        initializer=(_UseSingleThreadedExecutor if serialize_device_ops
                     else None))
    self._stats_lock = threading.Lock()

  @property
  def schedule(self):
    return self._schedule

  def _Functions(self, k, training, loss_fn):
    last = k == self._schedule.num_cells - 1
    key = (k, training, loss_fn if last else None)
    if last and key not in self._functions:
      # Keep one loss_fn's functions: a caller that passes a new closure each
      # step retraces the last cell each step, but does not leak functions.
      for stale in [other for other in self._functions if other[0] == k]:
        del self._functions[stale]
    if key not in self._functions:
      offset = sum(len(c.trainable_variables) for c in self._cells[:k])
      self._functions[key] = _CellFunctions(
          self._cells[k], self._cell_devices[k], k == 0, training,
          self._accumulators, offset, loss_fn if last else None)
    return self._functions[key]

  def ForwardBackward(self, micro_inputs, micro_targets, weights, batch_size,
                      loss_fn, training, seeds, collector, record_times=False):
    """Same contract as `PipelineExecutor.ForwardBackward`.

    Eagerly it runs on the device threads; inside a tf.function it emits the
    cell functions into the graph. With `record_times`, an eager action's
    (start, end) is host time around its function call (on GPUs a call can
    return before its kernels finish); a traced one's are tf.timestamp ops.
    """
    return self.Start(micro_inputs, micro_targets, weights, batch_size,
                      loss_fn, training, seeds, collector, record_times)()

  def Start(self, micro_inputs, micro_targets, weights, batch_size, loss_fn,
            training, seeds, collector, record_times=False):
    """Launches the step on the device threads; returns a function that waits.

    Starting several executors (one per replica) before waiting lets the
    replicas run at the same time.
    """
    sched = self._schedule
    if self._accumulators is None:
      self._accumulators = executor_lib.GradientAccumulators(
          [v for cell in self._cells for v in cell.trainable_variables])
    functions = [self._Functions(k, training, loss_fn)
                 for k in range(sched.num_cells)]
    batch_size = tf.cast(batch_size, tf.float32)
    if not tf.executing_eagerly():
      result = self._EmitInGraph(functions, micro_inputs, micro_targets,
                                 weights, batch_size, seeds, collector,
                                 record_times)
      return lambda: result
    mailbox = _Mailbox()
    state = {'loss': [], 'metrics': [], 'stats': {}, 'times': {}}

    last = sched.num_cells - 1

    # The last cell's d loss / d output per micro-batch, from F to B.
    loss_gradients = {}

    def RunDevice(device, actions):
      # Per micro-batch (x, seed), copied to this device once at F for B.
      saved_args = {}
      cells_done = set()
      try:
        for action in actions:
          # The call's device also places the function's unplaced ops (its
          # output identities), keeping each function on one device.
          with tf.device(device):
            RunAction(device, action, saved_args, cells_done)
      except BaseException:
        mailbox.Fail()
        raise

    def RunAction(device, action, saved_args, cells_done):
      kind, m, k = action
      fn = functions[k]
      if kind == schedule_lib.FORWARD:
        x = micro_inputs[m] if k == 0 else mailbox.Take(('y', m, k - 1))
        start = time.time()
        x, seed = _OnDevice((x, seeds[m]), device)
        saved_args[(m, k)] = (x, seed)
        try:
          if k == last:
            loss, metrics, stats, loss_gradients[m] = fn.forward(
                x, *_OnDevice((None if micro_targets is None else
                               micro_targets[m], seed, weights[m],
                               batch_size), device))
            state['loss'].append((m, loss))
            state['metrics'].append((m, metrics))
          else:
            y, stats = fn.forward(x, seed)
            mailbox.Put(('y', m, k), y)
        except executor_lib.CELL_ERRORS as e:
          raise executor_lib.CellError(self._name, self._cells, k, x,
                                       e) from e
        if collector is not None and stats:
          with self._stats_lock:
            state['stats'][(m, k)] = list(zip(fn.stat_layers, stats))
      else:
        x, seed = saved_args.pop((m, k))
        first = k not in cells_done
        cells_done.add(k)
        if k == last:
          dy = loss_gradients.pop(m)
        else:
          dy = _OnDevice(mailbox.Take(('dy', m, k + 1)), device)
        start = time.time()
        dx, _ = fn.backward(x, dy, seed, first)
        if k > 0:
          mailbox.Put(('dy', m, k), dx)
      if record_times:
        state['times'][action] = (start, time.time())

    device_names = {}
    for k, d in enumerate(sched.device_of_cell):
      device_names.setdefault(d, self._cell_devices[k])
    futures = [self._pool.submit(RunDevice, device_names[d], actions)
               for d, actions in enumerate(sched.device_actions)]

    def Wait():
      errors = []
      for future in futures:
        try:
          future.result()
        except _Aborted:
          pass
        except BaseException as e:  # pylint: disable=broad-except
          errors.append(e)
      if errors:
        raise errors[0]
      return self._Result(
          collector, state['stats'],
          [loss for _, loss in sorted(state['loss'], key=_First)],
          [values for _, values in sorted(state['metrics'], key=_First)],
          dict(state['times']) if record_times else None)
    return Wait

  def _EmitInGraph(self, functions, micro_inputs, micro_targets, weights,
                   batch_size, seeds, collector, record_times):
    """Inside a tf.function: the same cell functions, called in one graph.

    There are no threads to run; the actions are emitted in the schedule's
    global order, each device's chained by control dependencies as in the
    graph executor. The runtime then decides what overlaps. Each cell is
    still traced once, so tracing stays O(K) rather than O(K*M).
    """
    sched = self._schedule
    last = sched.num_cells - 1
    outputs, input_grads, loss_gradients, saved = {}, {}, {}, {}
    last_on_device, stats, times = {}, {}, {}
    losses, metric_list = [], []
    cells_done = set()
    for action in schedule_lib.Validate(sched):
      kind, m, k = action
      d = sched.device_of_cell[k]
      device = self._cell_devices[k]
      fn = functions[k]
      if record_times:
        if kind == schedule_lib.FORWARD:
          inputs = micro_inputs[m] if k == 0 else outputs[(m, k - 1)]
        else:
          inputs = (loss_gradients[m] if k == last else
                    input_grads[(m, k + 1)])
        start = executor_lib.Timestamp(
            list(last_on_device.get(d, [])) + [
                t for t in tf.nest.flatten(inputs) if t is not None], device)
        last_on_device[d] = [start]
      with tf.device(device), executor_lib.OrderAfter(last_on_device.get(d)):
        if kind == schedule_lib.FORWARD:
          x = micro_inputs[m] if k == 0 else outputs.pop((m, k - 1))
          saved[(m, k)] = x
          try:
            if k == last:
              loss, metrics, cell_stats, loss_gradients[m] = fn.forward(
                  x, None if micro_targets is None else micro_targets[m],
                  seeds[m], weights[m], batch_size)
              losses.append(loss)
              metric_list.append(metrics)
              done = [loss]
            else:
              y, cell_stats = fn.forward(x, seeds[m])
              outputs[(m, k)] = y
              done = [t for t in tf.nest.flatten(y) if t is not None]
          except executor_lib.CELL_ERRORS as e:
            raise executor_lib.CellError(self._name, self._cells, k, x,
                                         e) from e
          if collector is not None and cell_stats:
            stats[(m, k)] = list(zip(fn.stat_layers, cell_stats))
        else:
          dy = (loss_gradients.pop(m) if k == last else
                input_grads.pop((m, k + 1)))
          first = k not in cells_done
          cells_done.add(k)
          dx, finished = fn.backward(saved.pop((m, k)), dy, seeds[m], first)
          if k > 0:
            input_grads[(m, k)] = dx
          done = list(dx) + [finished]
      last_on_device[d] = done
      if record_times:
        end = executor_lib.Timestamp(done, device)
        times[action] = (start, end)
        last_on_device[d] = [end]
    # Read after every backward: the reads wait on the last accumulations.
    with tf.control_dependencies([t for ts in last_on_device.values()
                                  for t in ts]):
      return self._Result(collector, stats, losses, metric_list,
                          times if record_times else None)

  def _Result(self, collector, stats, losses, metric_list, times):
    """Hands over deferred statistics and sums the step's results.

    Args:
      collector: the step's DeferredStatsCollector (None outside training).
      stats: {(micro-batch, cell): [(layer, (count, stats))]}; added in key
        order so the applied update does not depend on timing.
      losses: each micro-batch's weighted loss, in micro-batch order.
      metric_list: each micro-batch's weighted metrics, in the same order.
      times: {Action: (start, end)} or None.
    """
    for key in sorted(stats):
      for layer, (count, cell_stats) in stats[key]:
        collector.Add(layer, cell_stats, count)
    with tf.device(self._cell_devices[-1]):
      loss = tf.add_n(losses)
      metrics = {}
      for values in metric_list:
        for name, value in values.items():
          metrics[name] = value if name not in metrics else (
              metrics[name] + value)
    return executor_lib.LossAndGradients(
        loss, self._accumulators.Read(), metrics, times)

def _First(pair):
  return pair[0]
