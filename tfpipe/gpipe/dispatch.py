"""Dispatchers: how a step's actions are issued to the devices.

The runtime (runtime.py) says what each action does; a dispatcher only
decides from where and in which order actions are issued, through one small
protocol: `step.Gather(item, store)` waits for an action's inputs and
`step.Execute(item, args, store)` runs it, returning tokens that exist once it
is done. There are two dispatchers:

  Inline   every action from the calling thread, in one global order that
           respects each device's order (schedule.Validate returns it). In a
           graph, each action waits for its device's previous action's
           outputs (OrderAfter), so the runtime keeps each device's order (which
           is what bounds 1F1B's memory) while different devices can still
           run at the same time. A gradient for another device is sent
           on only when that device is one action from using it
           (HandOver). This is the dispatcher for accelerators,
           whose runtimes overlap independent work of one graph, and the only
           one inside a tf.function.
  Threads  one Python thread per device (a replica's device, for replicas),
           issuing that device's actions in order and handing activations
           and gradients to its neighbours through a mailbox. Logical CPU
           devices of one process share its thread pool, so one graph's
           stages there compete for the same threads; separate calls from
           separate threads do run at the same time, because a function call
           releases the GIL. (On gRPC workers, one graph's stages already
           run at the same time, each on its own worker.)

Timing (`record_times`) wraps Execute, so it is the same for every action
and absent when not asked for: in a graph, timestamps on the action's device
ordered after the action's inputs and before its device's next action, and
ordered after nothing else (see _STAMP: bare `tf.timestamp` ops would order
the devices after each other); eagerly, host time after the inputs arrive
and after the action's outputs exist (the outputs are read back, which waits
for a GPU's kernels to finish).

ChooseExecutor says which of the two executor='auto' means for a pipeline's
devices and action size, from benchmarks/executor_choice.py's measurements.
"""

import concurrent.futures
import contextlib
import threading
import time

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # pylint: disable=g-direct-tensorflow-import


def OrderAfter(previous):
  """Makes what follows wait for the previous action of a device (graph mode).

  A control edge on an action's outputs is not enough: Grappler inlines the
  action's function call, and a control edge from an inlined call waits only
  for the call's stateful ops, so the next action would not wait for a pure
  forward. A device that runs one op at a time (a worker process with one
  inter-op thread) then runs every micro-batch's first layer, then every
  one's second, and hands its first activation on only when all are done:
  the stages serialize. So the edge comes from a read of one element of
  each output, which exists only once the output does.
  """
  if not previous or tf.executing_eagerly():
    return contextlib.nullcontext()
  deps = []
  for t in previous:
    if t is None or isinstance(t, tf.Variable):
      continue
    if isinstance(t, tf.IndexedSlices):
      t = t.values
    if _IsData(t):
      with tf.device(t.device):  # On the tensor's device, wherever issued.
        t = tf.reshape(t, [-1])[:1]
    deps.append(t)
  return tf.control_dependencies(deps) if deps else contextlib.nullcontext()


def _Stamp(unused_clock, *after):
  # One element of each tensor: a data dependency on it (see _STAMP).
  reads = [tf.reshape(t, [-1])[:1] for t in after]
  with tf.control_dependencies(reads):
    return tf.timestamp()


# A stamp is a call that reads one element of each tensor it comes after.
# A control dependency is not enough: Grappler inlines the action's function
# call, and a control edge from an inlined call waits only for its stateful
# ops, not for its outputs, so a stamp "after" a pure forward would run
# before the forward does. The clock argument is never read: it only makes
# the call an op with a (read-only) resource input. A bare tf.timestamp() is
# a stateful op with no resource input, and tf.function's automatic control
# dependencies chain all such ops in program order, across devices, so the
# stamps of different devices would wait for each other and serialize the
# very actions they time. Reads of one resource are not ordered among
# themselves.
_STAMP = tf.function(_Stamp, autograph=False)


def _IsData(t):
  return isinstance(t, tf.Tensor) and t.dtype not in (tf.resource,
                                                       tf.variant)


class _Clocks:
  """One unused scalar variable per device, the read-only resource input of
  that device's stamps (see _STAMP)."""

  def __init__(self):
    self._variables = {}

  def On(self, device):
    if device not in self._variables:
      # Made directly, out of the trace: a tf.Variable is refused in a
      # later trace of the caller's tf.function.
      with tf.init_scope(), tf.device(device):
        self._variables[device] = resource_variable_ops.ResourceVariable(
            0, trainable=False, name='timeline_clock')
    return self._variables[device]


def Timestamp(after, device, clocks=None):
  """A tf.timestamp() that runs after `after` on `device`.

  In a graph, pass `clocks` (a _Clocks) so that the stamps of different
  devices do not wait for each other.
  """
  if clocks is None or tf.executing_eagerly():
    with tf.device(device), OrderAfter(after):
      return tf.timestamp()
  after = [t.values if isinstance(t, tf.IndexedSlices) else t
           for t in after if t is not None]
  data = [t for t in after if _IsData(t)]
  with tf.device(device), OrderAfter([t for t in after if not _IsData(t)]):
    return _STAMP(clocks.On(device), *data)


def _Tensors(structure):
  return [t for t in tf.nest.flatten(structure)
          if isinstance(t, (tf.Tensor, tf.Operation))]


def _WaitFor(tokens):
  """Blocks until an eager action's outputs exist (kernels done on a GPU)."""
  for t in tokens:
    if isinstance(t, tf.Tensor):
      tf.reshape(t, [-1])[:1].numpy()
      return


class Program:
  """A step's actions: per device an ordered list, and one global order.

  Attributes:
    devices: {device key: (device name, [item, ...])}, each device's order;
      the key tells a replica's devices apart.
    order: [(device key, item)]: all items in an order that respects every
      device's order and every dependency (a valid single-thread order).
  """

  def __init__(self):
    self.devices = {}
    self.order = []

  def Add(self, key, device, item):
    self.devices.setdefault(key, (device, []))[1].append(item)
    self.order.append((key, item))


def HandOver(value, made_on, due_after):
  """`value`, made on device `made_on`, sent on only once `due_after` (the
  tokens of an action of the device that takes it) exist.

  In one graph a receive has no inputs of its own, so it pulls a tensor
  from its neighbour as soon as the neighbour has made it. A device whose
  backwards are slower than its neighbour's could then hold every gradient
  the neighbour has sent, up to M of them. Passed through an identity on
  its own device that waits for the taker's action before the one before
  its use, a gradient arrives while the taker runs the action right before
  it: one at a time, as the memory model counts it, and still ahead of its
  use, so the transfer overlaps that action. The sender holds it until
  then (memory_model counts it there).
  """
  if not due_after or tf.executing_eagerly():
    return value
  # Not after the taker's previous action, which the caller's context
  # orders this after: that would put the transfer on the critical path.
  with tf.control_dependencies(None), OrderAfter(due_after), tf.device(
      made_on):
    return tf.nest.map_structure(
        lambda t: tf.identity(t) if _IsData(t) else t, value)


class _DictStore:
  """Values handed between actions issued from one thread, in a valid order.

  `due_after` is set by the dispatcher before each action's Gather: the
  tokens of its device's action before the one before (see HandOver).
  """

  def __init__(self):
    self._items = {}
    self.due_after = None

  def Put(self, key, value):
    self._items[key] = value

  def Take(self, key):
    return self._items.pop(key)

  def TakeWhenDue(self, key, made_on):
    """Takes a value made on device `made_on` for this action's device,
    which receives it only during its action before this one."""
    return HandOver(self.Take(key), made_on, self.due_after)


class _Aborted(Exception):
  """Raised in a device thread when another thread has failed."""


class _Mailbox:
  """Hands values between device threads; a failure wakes every waiter."""

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

  def TakeWhenDue(self, key, unused_made_on):
    # Eager: the taker copies the value when it gathers it (OnDevice).
    return self.Take(key)

  def Fail(self):
    with self._condition:
      self._failed = True
      self._condition.notify_all()


class _HeldStore:
  """Holds an action's outputs until its end time is taken.

  Otherwise a neighbour's thread could start on them, and so appear to start
  before the action it depends on ended.
  """

  def __init__(self, store):
    self._store = store
    self._held = []

  def Put(self, key, value):
    self._held.append((key, value))

  def Take(self, key):
    return self._store.Take(key)

  def TakeWhenDue(self, key, made_on):
    return self._store.TakeWhenDue(key, made_on)

  def Release(self):
    for key, value in self._held:
      self._store.Put(key, value)


class _Timer:
  """Records each item's (start, end): tf.timestamp in a graph, else host time."""

  def __init__(self):
    self.times = {}
    self._lock = threading.Lock()
    self._clocks = _Clocks()

  def Run(self, item, device, args, previous, store, run):
    """Runs `run(store)` and times it; returns its done tokens."""
    if not tf.executing_eagerly():
      start = Timestamp(list(previous or []) + _Tensors(args), device,
                        self._clocks)
      with tf.control_dependencies([start]):
        done = run(store)
      end = Timestamp(list(done) + [start], device, self._clocks)
      self.times[item] = (start, end)
      return [end]
    held = _HeldStore(store)
    start = time.time()
    done = run(held)
    _WaitFor(done)
    end = time.time()
    with self._lock:
      self.times[item] = (start, end)
    held.Release()
    return done


class Inline:
  """Issues every action from the calling thread, in the global order."""

  name = 'inline'

  def __init__(self):
    self.last_tokens = []

  def Run(self, program, step, record_times=False):
    """Runs the program; returns {item: (start, end)} if record_times."""
    store = _DictStore()
    timer = _Timer() if record_times else None
    last = {}
    before_last = {}
    for key, item in program.order:
      device = program.devices[key][0]
      store.due_after = before_last.get(key)
      with tf.device(device), OrderAfter(last.get(key)):
        args = step.Gather(item, store)
        if timer is None:
          done = step.Execute(item, args, store)
        else:
          done = timer.Run(item, device, args, last.get(key), store,
                           lambda st: step.Execute(item, args, st))  # pylint: disable=cell-var-from-loop
      before_last[key] = last.get(key)
      last[key] = list(done)
    self.last_tokens = [t for tokens in last.values() for t in tokens]
    return timer.times if timer else None


class Threads:
  """Issues each device's actions from its own thread; waits for all of them."""

  name = 'threads'

  def __init__(self, name='pipe', thread_initializer=None):
    """Creates the dispatcher.

    Args:
      name: prefix of the device threads' names.
      thread_initializer: called once in each new device thread (e.g. to
        choose TensorFlow's executor for its function calls).
    """
    self._name = name
    self._initializer = thread_initializer
    self._pools = {}
    self.last_tokens = []

  def _Pool(self, num_devices):
    # Devices wait on each other, so every device needs its own thread.
    if num_devices not in self._pools:
      self._pools[num_devices] = concurrent.futures.ThreadPoolExecutor(
          max_workers=num_devices, thread_name_prefix=f'{self._name}-device',
          initializer=self._initializer)
    return self._pools[num_devices]

  def Run(self, program, step, record_times=False):
    if not tf.executing_eagerly():
      raise RuntimeError('Threads dispatch runs eagerly; inside a '
                         'tf.function use Inline.')
    store = _Mailbox()
    timer = _Timer() if record_times else None

    def RunDevice(device, items):
      try:
        for item in items:
          with tf.device(device):
            args = step.Gather(item, store)
            if timer is None:
              step.Execute(item, args, store)
            else:
              timer.Run(item, device, args, None, store,
                        lambda st: step.Execute(item, args, st))  # pylint: disable=cell-var-from-loop
      except BaseException:
        store.Fail()
        raise

    pool = self._Pool(len(program.devices))
    futures = [pool.submit(RunDevice, device, items)
               for device, items in program.devices.values()]
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
    return timer.times if timer else None


# executor='auto' picks 'threads' only on local CPU devices, and only when
# one forward action (a cell on a micro-batch) costs at least this many
# flops. Below it the thread hand-off and the per-action function call cost
# more than the overlap gains (benchmarks/executor_choice.py; the
# measurements are in benchmarks/RESULTS.md, "Choosing the executor").
THREADS_MIN_FORWARD_FLOPS = 4e9


def ChooseExecutor(devices, forward_flops_per_action):
  """'graph' or 'threads' for executor='auto' (see the executor param).

  'graph' unless the devices are two or more local CPU devices and one
  forward action costs at least THREADS_MIN_FORWARD_FLOPS. GPU and TPU
  runtimes overlap the cells of one graph themselves, and so does TF's
  distributed runtime on remote (gRPC) workers: the step is one function,
  partitioned per worker, whose parts run at the same time and exchange
  tensors by send/recv, worker to worker. With 'threads' each action would
  instead be a remote function call from the controller
  (benchmarks/pipeline_efficiency.py --mode=grpc_threads against
  --mode=grpc_graph; benchmarks/remote_action_costs.py for the per-action
  costs).

  Args:
    devices: the pipeline's device names.
    forward_flops_per_action: the mean forward flops of one cell on one
      micro-batch, from the cells' cost model; None if unknown.
  """
  specs = [tf.DeviceSpec.from_string(d) for d in devices]
  if any((s.device_type or 'CPU') != 'CPU' for s in specs):
    return 'graph'
  if any(s.job not in (None, 'localhost') for s in specs):
    return 'graph'
  if len(set(devices)) < 2:
    return 'graph'  # One device: nothing to overlap.
  if forward_flops_per_action is None or (
      forward_flops_per_action < THREADS_MIN_FORWARD_FLOPS):
    return 'graph'
  return 'threads'
