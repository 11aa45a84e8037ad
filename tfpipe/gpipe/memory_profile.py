"""One short profiled step per distinct cell: what its actions hold in memory.

PipeDream profiles a model once, on one device, and plans from that. This
module does the same for memory (and, on the side, time): each distinct
cell runs as a one-cell pipeline on this process's CPU, through the engine's
own training step (`PipeliningLayer.ComputeLossAndGradients`), with a
dispatcher that issues one action at a time and reads TensorFlow's allocator
around each (action_memory.py): the bytes in use before it, the peak while
it runs and the bytes in use after it, and for a forward the buffers it
leaves for its backward. GPipe with M=2 gives every kind of action a cell
has:

    F0   not followed by its B: keeps what B0 will read (the input only,
         re-materialized; the engine's recorded activations, not)
    F1   followed by B1: on the last cell they run as one call (fused)
    B0   the backward of a kept forward (recomputing it, re-materialized)

run once with remat_policy='always' and once with 'never'. So what the
memory model predicts is what this engine keeps, whatever that is; nothing
about it is written down here. A profile runs with the devices' intra-op
threads (`ProfileRequest.intra_op_threads`): how many ops run at once
decides how many working sets coexist, the optimizer update's above all.
For devices that run each action as a call on TensorFlow's single-threaded
executor (a worker process's CPU: gpipe/cell_runtime.py) the profile's
actions are such calls too (`ProfileRequest.single_threaded_calls`): on the
default executor two of an action's ops may run at once, and their
temporaries add up (AmoebaNet-D's first cell's backward at micro-batch 4,
on a CPU whose TensorFlow runs without oneDNN: 72 MiB on the default
executor, 40 MiB one op at a time; its worker peaked at 44 MiB in all).

A cell that is not last gets a stand-in loss (the mean of its float
outputs), whose gradient a real pipeline receives from the next device
instead: the bytes of that gradient are taken out of what F keeps and of
B's working set (memory_model adds the received gradient back). The
optimizer's slots and the working set of its update (global-norm clipping
and the step) are measured on the cell's variables with the task's own
optimizer.

A cell that is not first is profiled as it runs in a pipeline: its
backward also computes its input's gradient (the one-cell pipeline's
`first_cell_input_gradient`), so B's peak holds that gradient where it is
made, and its forward keeps what that needs. What of its input a forward's
record holds is read from the buffers' addresses (`kept_input`): a received
input that the record does not hold is freed when the forward ends
(AmoebaNet-D's cells without re-materialization: their backward reads the
ReLU's output, not the input). Each alone predicted worse than neither
(benchmarks/RESULTS.md, memory_model_accuracy): with the input gradient
alone, AmoebaNet-D's second device without re-materialization at M=1
counted both the gradient's partial sums and an input it no longer holds;
with the freed input alone, that device lacked the gradient it makes.

On the CPU each distinct cell is profiled in a fresh process, whose
allocator has held that cell only, as its worker's has: what BFC grants a
request depends on the free chunks that earlier tensors left
(ProfileInSubprocess). A process's allocator settles on one packing of the
step's chunks, which what ran in it before shapes, and a worker's on one of
its own: so each remat mode and micro-batch size of a cell (a worker runs
one, N/M, unless M does not divide N) is profiled in processes of its
own, `ProfileRequest.profile_runs` of them (3), and each quantity is their
median (memory_model.MedianProfile). (The LM's first cell of four without
re-materialization: a backward of 17.0-17.3 MiB in a fresh process, 17.0
to 20.8 after the re-materialized profile in the same one.) A fresh
one-region allocator can still hold more than the tensors it was given
(gpipe/allocator_slack.py measures that).

Counting bytes needs TensorFlow's BFC allocator on the CPU, which only
TF_CPU_ALLOCATOR_USE_BFC=true set before TensorFlow starts gives: the
processes that `ProfileInSubprocess` starts (python -m
tfpipe.gpipe.memory_profile) set it. A GPU's allocator always counts, so
a GPU profile may run in the process that holds the GPU (`ProfileCells`).
"""

import copy
import dataclasses
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time

from tfpipe import fork_server
from tfpipe.gpipe import action_memory
from tfpipe.gpipe import memory_model
from tfpipe.gpipe import profile_request
from tfpipe.gpipe import tensor_buffers

# TensorFlow reads it when it starts: the intra-op threads of the process.
INTRA_OP_ENV = 'TF_NUM_INTRAOP_THREADS'
# And this one: a GPU's memory is taken as needed, not all at once.
GPU_GROWTH_ENV = 'TF_FORCE_GPU_ALLOW_GROWTH'
# Steps per configuration: the first traces; the others are recorded. The
# order in which TensorFlow runs an action's independent ops varies, and
# with it the action's peak (by a few percent), so each peak is the largest
# of the recorded steps, and each time the shortest (see _Worst for what a
# forward keeps).
_RECORDED_STEPS = 3


# What a profile needs, picklable; and when two cells profile alike.
ProfileRequest = profile_request.ProfileRequest
CellSignature = profile_request.CellSignature


def _Tf():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf


def LocalCpu():
  """This process's own CPU device (a controller's, in a cluster)."""
  tf = _Tf()
  with tf.device('/CPU:0'):
    return tf.constant(0).device


def AllocatorName(device=None):
  """The name get_memory_info takes for a device ('GPU:1'); this process's
  CPU's for None."""
  from tfpipe import device_names  # pylint: disable=g-import-not-at-top
  return 'CPU:0' if device is None else device_names.AllocatorName(device)


def CheckAllocatorCounts(device=None):
  """Raises RuntimeError unless the device's allocator counts bytes (a
  GPU's always does; this process's CPU's only with the BFC allocator)."""
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  if AllocatorName(device).startswith('CPU') and not memory_limit.UsesBfc():
    raise RuntimeError(
        'Profiling memory needs TensorFlow\'s BFC allocator on the CPU: set '
        f'{memory_limit.BFC_ENV}=true before TensorFlow starts, or use '
        'memory_profile.ProfileInSubprocess.')


LeafBytes = tensor_buffers.LeafBytes


def Bytes(structure):
  tf = _Tf()
  return sum(LeafBytes(t) for t in tf.nest.flatten(structure)
             if t is not None)


def _FloatBytes(structure):
  tf = _Tf()
  return sum(LeafBytes(t) for t in tf.nest.flatten(structure)
             if t is not None and tf.as_dtype(t.dtype).is_floating)


def StandInLoss(outputs, unused_targets=None):
  """The loss of a cell that is not last: the mean of its float outputs."""
  tf = _Tf()
  floats = [t for t in tf.nest.flatten(outputs) if t.dtype.is_floating]
  return tf.add_n([tf.reduce_mean(tf.cast(t, tf.float32)) for t in floats])


def _Take(structure, n):
  """The first n examples of every leaf, repeating the batch if it is short."""
  tf = _Tf()

  def Take(t):
    t = tf.convert_to_tensor(t)
    if t.shape[0] < n:
      t = tf.concat([t] * (-(-n // t.shape[0])), axis=0)
    return tf.identity(t[:n])
  return tf.nest.map_structure(Take, structure)


def RandomInputs(shape, n):
  """float32 tensors of a nested shape (batch dim None) with n examples."""
  tf = _Tf()
  from tfpipe import cost_model  # pylint: disable=g-import-not-at-top
  return cost_model.MapShapes(
      lambda s: tf.random.stateless_normal((n,) + tuple(s[1:]), seed=[1, 2]),
      shape)


def _Worst(steps, kind, micro_batch):
  """The action (kind, micro_batch) over the recorded steps: its largest
  peak, its shortest time, and what it keeps (`delta`).

  A forward keeps the buffers of its record (`held`), in the chunks BFC gave
  them, which can be larger (a request gets a whole free chunk under twice
  its size): AmoebaNet-D's first cell of four held 4.8 MiB of buffers at
  micro-batch 4 and took about 6.0 MiB on its worker, as its profile did.
  The allocator's difference around the forward counts those chunks, but
  moves up when other tensors are made while it runs and down when they are
  freed. So a forward keeps the smallest difference of the recorded steps,
  and never less than its buffers. (Measured on the whole grid, the same
  workers' peaks predicted from profiles run again: 144, 143 and 148 of
  162 configurations within 15% this way; 141, 139 and 128 with the buffers
  alone; 132 with the largest difference, the rule before.)
  """
  found = [r for records in steps for r in records
           if r.action.kind == kind and r.action.micro_batch == micro_batch]
  held = [r.held for r in found if r.held is not None]
  if held:
    kept = max(max(held), min(r.delta for r in found))
  else:
    kept = max(r.delta for r in found)
  held_input = [r.held_input for r in found if r.held_input is not None]
  return action_memory.ActionRecord(
      found[0].action, 0, max(r.transient for r in found), kept,
      min(r.seconds for r in found), max(held) if held else None,
      max(held_input) if held_input else None)


def ProfileCell(cell_params, inputs, targets, loss_fn, micro_batch_size,
                is_last, optimizer_params, clip_gradient_norm=1.0,
                single_threaded_calls=False, device=None, is_first=True,
                modes=(memory_model.REMAT, memory_model.NO_REMAT)):
  """The CellMemory of one cell at one micro-batch size.

  Args:
    cell_params: the cell's params (a FeatureExtractionLayer of layers).
    inputs: the cell's input, at least one example (repeated as needed).
    targets: the loss's targets (last cell), or None.
    loss_fn: the model's loss (last cell); other cells use StandInLoss.
    micro_batch_size: n.
    is_last: whether the cell is the pipeline's last, which runs the loss.
    optimizer_params: the task's optimizer params (trainer.optimizer).
    clip_gradient_norm: the task's clipping, part of the update.
    single_threaded_calls: run each action as a call on the single-threaded
      executor, as a worker's CPU does (ProfileRequest).
    device: where the cell runs and whose allocator is read (default: this
      process's CPU).
    is_first: whether the cell is the pipeline's first. Any other cell's
      backward also computes the gradient of its input, which it hands
      back; its actions are profiled doing so (see the module docstring).
    modes: the remat modes to profile, in turn; the variables and the
      optimizer update are measured in the first.

  Returns:
    A memory_model.CellMemory.
  """
  CheckAllocatorCounts(device)
  allocator = AllocatorName(device)
  tf = _Tf()
  from tfpipe.gpipe import pipelining_layer  # pylint: disable=g-import-not-at-top
  n = int(micro_batch_size)
  batch = _Take(inputs, 2 * n)
  batch_targets = _Take(targets, 2 * n) if (is_last and
                                            targets is not None) else None
  loss = loss_fn if is_last else StandInLoss
  result = memory_model.CellMemory(micro_batch_size=n, is_last=is_last)
  single = _Take(inputs, n)
  result.input_bytes = Bytes(single)
  result.input_gradient_bytes = _FloatBytes(single)
  result.includes_input_gradient = (not is_first and
                                    result.input_gradient_bytes > 0)
  for mode in modes:
    pipe = pipelining_layer.PipeliningLayer.Params().Set(
        name='profile', cell_tpl=[cell_params.Copy()], num_micro_batches=2,
        devices=[device or LocalCpu()], executor='threads', schedule='gpipe',
        remat_policy=mode).Instantiate()
    if single_threaded_calls:
      for cell in pipe.runtime.cells[0]:
        cell.single_threaded_calls = True
    pipe.runtime.first_cell_input_gradient = result.includes_input_gradient
    recorder = action_memory.MemoryRecordingDispatcher(allocator)
    pipe.SetThreadsDispatcher(recorder)
    steps = []
    for i in range(_RECORDED_STEPS + 1):
      recorder.records = []
      out = pipe.ComputeLossAndGradients(batch, batch_targets, loss)
      del out
      if i:
        steps.append(recorder.records)
    if not result.output_bytes:
      y = pipe.cells[0](single, training=False)
      result.output_bytes = Bytes(y)
      result.output_gradient_bytes = _FloatBytes(y)
      del y
    forward = _Worst(steps, 'F', 0)
    backward = _Worst(steps, 'B', 0)
    fused = _Worst(steps, 'F', 1)
    gradient = 0 if is_last else result.output_gradient_bytes
    # Re-materialized, the stand-in loss's F also keeps its output gradient
    # (B0 reads it); without, B0 computes it. A pipeline receives it.
    result.kept[mode] = max(0, forward.delta - (
        gradient if mode == memory_model.REMAT else 0))
    if forward.held_input is not None:
      result.kept_input[mode] = min(forward.held_input, result.input_bytes)
    result.forward_peak[mode] = max(0, forward.transient - (
        gradient if mode == memory_model.REMAT else 0))
    result.backward_peak[mode] = max(0, backward.transient - (
        gradient if mode == memory_model.NO_REMAT else 0))
    result.fused_peak = max(result.fused_peak, fused.transient)
    result.backward_s[mode] = backward.seconds
    if mode in (memory_model.REMAT, modes[0]):  # Re-materialized if there.
      result.forward_s = forward.seconds
      result.fused_s = fused.seconds
    if mode == modes[0]:
      variables = pipe.trainable_variables
      result.variable_bytes = Bytes(variables)
      result.other_variable_bytes = sum(
          Bytes(v) for v in pipe.cells[0].non_trainable_variables)
      (result.optimizer_bytes, result.update_peak,
       result.update_s) = _ProfileUpdate(variables, optimizer_params,
                                         clip_gradient_norm, device)
    del pipe, recorder
  return result


def _ProfileUpdate(variables, optimizer_params, clip_gradient_norm,
                   device=None):
  """(slot bytes, update working set, seconds) of the task's optimizer.

  The update is the trainer's: global-norm clipping, then the optimizer's
  step, traced; the gradients are fresh tensors, as the accumulators' reads
  are.
  """
  tf = _Tf()
  from tfpipe.trainer import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  if not variables:
    return 0, 0, 0.0
  allocator = AllocatorName(device)
  optimizer = optimizer_lib.BuildOptimizer(optimizer_params, 1e-3)
  optimizer.build(variables)
  # Its own counters (iterations, learning rate) live with the controller.
  slots = sum(LeafBytes(v) for v in optimizer.variables
              if v is not optimizer.iterations and
              'learning_rate' not in v.name)
  with tf.device(device or LocalCpu()):
    gradients = [tf.ones(v.shape, v.dtype) * 1e-3 for v in variables]

  @tf.function
  def Update(grads):
    optimizer_lib.ApplyGradients(optimizer, zip(grads, variables),
                                 clip_norm=clip_gradient_norm,
                                 fused=optimizer_params.fused)
    return tf.constant(True)
  Update(gradients)
  peak, seconds = 0, float('inf')
  for _ in range(_RECORDED_STEPS):
    tf.config.experimental.reset_memory_stats(allocator)
    before = tf.config.experimental.get_memory_info(allocator)['current']
    start = time.perf_counter()
    bool(Update(gradients))
    if allocator.startswith('GPU'):  # Until the update's kernels are done.
      tf.reshape(variables[-1], [-1])[:1].numpy()
    seconds = min(seconds, time.perf_counter() - start)
    peak = max(peak, tf.config.experimental.get_memory_info(
        allocator)['peak'] - before)
  del optimizer
  return slots, max(0, peak), seconds


def ProfileCells(request, log=None):
  """A memory_model.CellProfile per cell of the request; equal cells once.

  On the CPU each distinct cell is profiled in a fresh process of its own
  (ProfileInSubprocess), as each runs on a worker of its own. Otherwise
  (a GPU of this process), here, in a process whose allocator for
  request.device counts bytes (CheckAllocatorCounts).
  """
  if (request.device is None and request.process_per_cell and
      not request.in_this_process):
    return ProfileInSubprocess(request, log=log)
  CheckAllocatorCounts(request.device)
  if request.inputs is None and request.input_params is not None:
    tf = _Tf()
    dataset = request.input_params.Instantiate().GetDataset(0)
    request.inputs, request.targets = tf.nest.map_structure(
        lambda t: t.numpy(), next(iter(dataset)))
  done = {}
  profiles = []
  last = request.num_cells - 1
  for k, cell, shape in zip(request.positions, request.cells,
                            request.input_shapes):
    key = CellSignature(cell, shape, k == last, k == 0)
    if key not in done:
      start = time.perf_counter()
      measurements = []
      for n in request.micro_batch_sizes:
        inputs = (request.inputs if k == 0 else RandomInputs(shape, 1))
        measurements.append(ProfileCell(
            cell, inputs, request.targets, request.loss_fn, n, k == last,
            request.optimizer_params, request.clip_gradient_norm,
            request.single_threaded_calls, request.device, is_first=k == 0,
            modes=request.modes))
      done[key] = memory_model.CellProfile(measurements)
      if log:
        log(f'profiled cell {k} ({cell.name}) at micro-batch sizes '
            f'{request.micro_batch_sizes} in '
            f'{time.perf_counter() - start:.1f}s')
    profiles.append(done[key])
  if request.allocator_slack:
    _AddBuildSlack(request, done, log)
  return profiles


def _AddBuildSlack(request, done, log=None):
  """Sets each distinct cell's allocator_slack_bytes, measured by
  allocator_slack.BuildSlack in a fresh allocator per cell: on a GPU, one
  logical GPU per cell of one process; on the CPU, which has one allocator
  per process, a process per cell. (One allocator that built and freed another cell first
  is not fresh: on an H200, the MLP K=4's second cell then showed no slack,
  where a fresh device held 4 MiB more.)"""
  first_of = profile_request.DistinctCells(request)
  keys = list(first_of)
  # Room for the largest build: its variables, slots, and an initializer's
  # temporaries (a few of the variables' size).
  largest = max(
      5 * m.variable_bytes + m.optimizer_bytes + m.other_variable_bytes
      for key in keys for m in [done[key].At(done[key].sizes[0])])
  memory_mb = int(math.ceil(largest / 2.0**20)) + 64
  on_gpu = request.device is not None and 'GPU' in request.device.upper()
  groups = [keys] if on_gpu else [[key] for key in keys]
  slacks = []
  why = None
  for group in groups:
    # Select and the assignments below replace the copy's lists, not the
    # request's.
    sub = copy.copy(request)
    sub.Select([first_of[key] for key in group])
    sub.inputs = sub.targets = sub.input_params = None
    try:
      measured = RunInSubprocess(sub, 'slack', log=log,
                                 memory_mb=memory_mb)
      if measured is None:
        why = (f'no one-region allocator of {memory_mb} MiB could be made (on '
               'the CPU, a cap above half of this host\'s memory is left to '
               'grow)')
    except (RuntimeError, subprocess.TimeoutExpired) as e:
      measured, why = None, str(e)
    if measured is None:
      if log:
        log(f'allocator slack not measured, predicted without it: {why}')
      return
    slacks += measured
  for key, slack in zip(keys, slacks):
    for m in done[key].by_size.values():
      m.allocator_slack_bytes = slack
  if log:
    log('allocator slack per distinct cell (MiB): ' +
        ', '.join(f'{s / 2.0**20:.2f}' for s in slacks))


def ProfileInSubprocess(request, timeout_s=900, log=None):
  """ProfileCells in fresh Python processes with the BFC allocator: on the
  CPU, one process per distinct cell (unless not
  `request.process_per_cell`); on a GPU, one for all.

  A profile reads an allocator whose free chunks are what earlier tensors
  left, and BFC hands a request a whole free chunk under twice its size. In
  one process that had profiled the MLP's first cell of four, the second
  cell's backward took 8 MiB for 4 MiB of weight gradients, in two
  profiles of three; profiled alone, 4.1 MiB, and its worker took about 4.5
  (benchmarks/RESULTS.md, memory_model_accuracy). A worker's allocator has
  held its own cell only, so a CPU profile does the same.

  Each of `request.modes` (one policy may read one) of each distinct cell,
  at each micro-batch size, runs in `request.profile_runs` processes, one
  after another (their times are measured too), and each of its
  quantities is the median of theirs (JoinModes puts the modes together):
  a worker runs one size, and so does the trainer's profile of its step;
  a size profiled after another in one process is packed as no such
  worker packs it. Two profiles of the memory_model_accuracy grid's K=2
  and K=4 configurations predicted each device's peak up to 17.3% apart
  from one process per cell, and up to 10.1% apart this way
  (benchmarks/RESULTS.md).

  Returns the list of CellProfile. Raises RuntimeError with the child's
  error when it fails, subprocess.TimeoutExpired after timeout_s in all.
  """
  if request.device is not None or not request.process_per_cell:
    return [memory_model.CellProfile.FromDict(p) for p in RunInSubprocess(
        request, 'profile', timeout_s=timeout_s, log=log)]
  deadline = time.monotonic() + timeout_s
  last = request.num_cells - 1
  first_of = profile_request.DistinctCells(request)
  done = {}
  for key, i in first_of.items():
    sub = copy.copy(request)  # Select replaces the copy's lists.
    sub.Select([i])
    sub.in_this_process = True
    sub.allocator_slack = False  # Measured below, for all cells at once.
    if sub.positions[0] not in (0, last):  # Reads no batch: random inputs.
      sub.inputs = sub.targets = sub.input_params = None
    done[key] = JoinModes(*(
        memory_model.CellProfile([
            _MedianOfProcesses(sub, mode, n, deadline, log)
            for n in request.micro_batch_sizes])
        for mode in request.modes))
  if request.allocator_slack:
    _AddBuildSlack(request, done, log)
  return [done[CellSignature(cell, shape, k == last, k == 0)]
          for k, cell, shape in zip(request.positions, request.cells,
                                    request.input_shapes)]


def _MedianOfProcesses(request, mode, n, deadline, log=None):
  """The CellMemory of the request's one cell in one remat mode at
  micro-batch size n: each quantity's median over `request.profile_runs`
  fresh processes."""
  one = copy.copy(request)
  one.modes, one.micro_batch_sizes = (mode,), [n]
  runs = []
  for _ in range(max(1, request.profile_runs)):
    [profile] = RunInSubprocess(
        one, 'profile', log=log,
        timeout_s=max(1.0, deadline - time.monotonic()))
    runs.append(memory_model.CellProfile.FromDict(profile))
  return memory_model.MedianProfile(runs).by_size[n]


def JoinModes(first, *others):
  """One CellProfile of one cell from profiles of its remat modes: what is
  keyed by mode (the CellMemory's dict fields) from the profile of that
  mode, the rest (variables, the build's slack, the update, the forward's
  and the fused call's times) from the first's; the fused call's peak, the largest.
  Updates and returns `first`."""
  for other in others:
    for n in first.sizes:
      into, more = first.by_size[n], other.by_size[n]
      for field in dataclasses.fields(more):
        values = getattr(more, field.name)
        if isinstance(values, dict):  # Keyed by mode: this one's added.
          setattr(into, field.name, {**values, **getattr(into, field.name)})
      into.fused_peak = max(into.fused_peak, more.fused_peak)
  return first


def SubprocessEnv(request, mode, memory_mb=None):
  """The environment of RunInSubprocess's child: capped at memory_mb, with
  the request's intra-op threads; a GPU profile's memory grows, a slack
  measurement's GPU is one region (as a fresh device's is)."""
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  env = memory_limit.CappedEnv(memory_mb)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  if mode == 'slack':
    if request.device is None or 'GPU' not in request.device.upper():
      env['CUDA_VISIBLE_DEVICES'] = ''
    # A fresh GPU's allocator is one region of its memory from the start;
    # one that grows (inherited from a profiling process) holds no slack.
    env.pop(GPU_GROWTH_ENV, None)
  elif request.device is None:
    env['CUDA_VISIBLE_DEVICES'] = ''  # A CPU profile (fork_server.Run).
  else:
    if request.gpu_memory_mb:
      env.pop(GPU_GROWTH_ENV, None)  # One region of that size (_Main).
    else:
      # A GPU profile takes what it needs, not the whole GPU, and gives it
      # back when the process ends.
      env[GPU_GROWTH_ENV] = 'true'
  if request.intra_op_threads:
    env[INTRA_OP_ENV] = str(request.intra_op_threads)
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  env['PYTHONPATH'] = os.pathsep.join(
      [root] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
  return env


def RunInSubprocess(request, mode, timeout_s=900, log=None, memory_mb=None):
  """Runs the request in a fresh process (fork_server.Run), returning what
  it returned: mode 'profile', ProfileCells (memory_profile._Main);
  'slack', allocator_slack.BuildSlack, capped at memory_mb."""
  with tempfile.TemporaryDirectory(prefix='tfpipe_profile_') as tmp:
    request_path = os.path.join(tmp, 'request.pickle')
    output_path = os.path.join(tmp, 'output.pickle')
    with open(request_path, 'wb') as f:
      pickle.dump(request, f)
    env = SubprocessEnv(request, mode, memory_mb)
    module = {'profile': 'tfpipe.gpipe.memory_profile',
              'slack': 'tfpipe.gpipe.allocator_slack'}[mode]
    proc = fork_server.Run(module, [request_path, output_path], env, timeout_s)
    if log:
      for line in proc.stdout.splitlines():
        log(line)
    if proc.returncode or not os.path.exists(output_path):
      raise RuntimeError('Profiling the cells\' memory failed: ' +
                         (proc.stderr.strip().splitlines() or ['?'])[-1])
    with open(output_path, 'rb') as f:
      return pickle.load(f)


def _Main(argv):
  from tfpipe import quiet  # pylint: disable=g-import-not-at-top
  quiet.ImportTensorFlow()
  request_path, output_path = argv[1:3]
  with open(request_path, 'rb') as f:
    request = pickle.load(f)
  if request.device and request.gpu_memory_mb:
    tf = _Tf()
    gpus = tf.config.list_physical_devices('GPU')
    if gpus:  # Before the first op: GPU:0 becomes one region of that size.
      tf.config.set_logical_device_configuration(gpus[0], [
          tf.config.LogicalDeviceConfiguration(
              memory_limit=request.gpu_memory_mb)])
  result = [p.ToDict() for p in ProfileCells(
      request, log=lambda line: print(line, flush=True))]
  with open(output_path, 'wb') as f:
    pickle.dump(result, f)


if __name__ == '__main__':
  _Main(sys.argv)
