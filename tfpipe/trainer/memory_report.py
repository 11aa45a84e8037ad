"""What the memory model predicts for an experiment, device by device.

The bridge between an experiment's params (the trainer's `p`) and
gpipe.memory_model: the experiment's cells are profiled once (one short
step per distinct cell, gpipe.memory_profile, each in a fresh process
with a counting allocator, as each runs on a device of its own; on a GPU,
in the process that holds it), with an example batch of
its own input and its own loss and optimizer; the walk of the schedule then
gives each device's peak. `--mode=inspect_model` prints it next to the
budget (`BudgetLines`), the planner plans from the same profiles, and an
out-of-memory error quotes it.
"""

import math

from tfpipe import cost_model
from tfpipe.gpipe import memory_model
from tfpipe.gpipe import memory_profile
from tfpipe.gpipe import partition
from tfpipe.trainer import task as task_lib

MIB = 2**20


def CellInputShapes(cells, input_shape):
  """Each cell's input shape (batch dim as given), from the cost model."""
  shapes, shape = [], input_shape
  for cell in cells:
    shapes.append(shape)
    metas = partition.LayerCosts(list(cell.sub), shape)
    shape = metas[-1].output_shape
  return shapes


def ExampleBatch(p):
  """One batch of the experiment's training input, as numpy leaves."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  dataset = p.input.Instantiate().GetDataset(0)
  inputs, targets = next(iter(dataset))
  return (tf.nest.map_structure(lambda t: t.numpy(), inputs),
          tf.nest.map_structure(lambda t: t.numpy(), targets))


def ReplicaBatchSize(p):
  """N: the examples one replica's step splits into micro-batches."""
  return p.input.batch_size // p.task.pipeline.num_replicas


def StepMicroBatchSizes(p):
  """The micro-batch sizes the experiment's step runs."""
  return sorted(set(memory_model.MicroBatchSizes(
      ReplicaBatchSize(p), p.task.pipeline.num_micro_batches)))


def RematModes(remat_policy, num_micro_batches, step_time=False):
  """The remat modes (memory_model.REMAT, NO_REMAT) whose profiles a
  prediction for this policy reads: its micro-batches' (the memory walk's,
  memory_model.UsesRemat); with `step_time`, both unless 'never', as the
  recompute's time is a re-materialized backward's less a plain one's
  (planner.StepTime). Each mode of a cell is profiled in processes of its
  own, so a mode not read is a process (or `profile_runs`) saved."""
  if step_time:
    used = {memory_model.NO_REMAT} if remat_policy == 'never' else {
        memory_model.REMAT, memory_model.NO_REMAT}
  else:
    used = {memory_model.REMAT if memory_model.UsesRemat(
        remat_policy, m, num_micro_batches) else memory_model.NO_REMAT
            for m in range(num_micro_batches)}
  return tuple(mode for mode in (memory_model.REMAT, memory_model.NO_REMAT)
               if mode in used)


def ProfileRequest(p, cells=None, micro_batch_sizes=None, example=None,
                   intra_op_threads=0, single_threaded_calls=False,
                   device=None, allocator_slack=True, process_per_cell=True,
                   profile_runs=3, modes=None):
  """A memory_profile.ProfileRequest for the experiment's cells.

  Args:
    p: the experiment params.
    cells: the cell params (default: the experiment's own cut).
    micro_batch_sizes: sizes to profile (default: the step's).
    example: (inputs, targets) numpy batch; None: the profiling process
      reads one of p.input's (this process runs no TensorFlow op).
    intra_op_threads: each device's intra-op threads (0: TensorFlow's
      default), which the profile runs with.
    single_threaded_calls: the devices are worker processes' CPUs, which run
      each action as a call on the single-threaded executor; the profile's
      actions then are too (memory_profile.ProfileRequest).
    device: profile on this device (a GPU of this process) rather than on
      a CPU (memory_profile.ProfileRequest.device).
    allocator_slack: whether the devices' allocators are one region from
      the start, as GPUs' and capped workers' are, and so hold the slack
      that allocator_slack.BuildSlack measures. Not on worker processes'
      CPUs (`single_threaded_calls`): the controller makes their variables'
      initial values (initial_values), so no initializer's temporaries
      leave the hole that the slack fills.
    process_per_cell: on the CPU, each distinct cell in a fresh process
      (memory_profile.ProfileRequest.process_per_cell); False for a
      planner's one-layer cells.
    profile_runs: with `process_per_cell`, the processes that profile each
      remat mode and micro-batch size of each distinct cell, whose median
      is taken (1 is about three times faster and less steady:
      memory_profile.ProfileRequest.profile_runs).
    modes: the remat modes to profile (RematModes); None: both, for
      predictions under any policy.
  """
  model = p.task.model.Instantiate()
  if cells is None:
    cells = task_lib.PartitionCells(p.task, model)
  inputs, targets = example if example is not None else (None, None)
  request = memory_profile.ProfileRequest(
      cells, CellInputShapes(cells, model.InputShape()), inputs, targets,
      model.Loss, micro_batch_sizes or StepMicroBatchSizes(p),
      p.task.train.optimizer, p.task.train.clip_gradient_norm)
  if example is None:
    request.input_params = p.input
  request.intra_op_threads = intra_op_threads
  request.single_threaded_calls = single_threaded_calls
  request.device = device
  request.allocator_slack = allocator_slack and not single_threaded_calls
  request.process_per_cell = process_per_cell
  request.profile_runs = profile_runs
  if modes is not None:
    request.modes = tuple(modes)
  return request


def Profile(request, log=None, in_subprocess=False):
  """The request's CellProfiles: on a GPU of this process, here; on the
  CPU, or with `in_subprocess` (a process that has not set up its devices
  yet), in fresh processes with the devices' intra-op threads, one per
  distinct cell unless not `request.process_per_cell`
  (memory_profile.ProfileInSubprocess)."""
  if request.device is not None and not in_subprocess:
    return memory_profile.ProfileCells(request, log=log)
  return memory_profile.ProfileInSubprocess(request, log=log)


def _DtypeSize(dtype):
  import numpy as np  # pylint: disable=g-import-not-at-top
  try:
    return np.dtype(dtype).itemsize
  except TypeError:
    return 4


def _ExampleBytes(structure, batch_size):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  total = sum(np.asarray(t).nbytes for t in tf.nest.flatten(structure))
  return total / max(batch_size, 1)


def StepConfig(p, example=None):
  """The memory_model.StepConfig of the experiment's step (one replica)."""
  pp = p.task.pipeline
  devices = list(pp.devices or [])[:pp.num_partitions]
  device_of_cell = None
  if devices and len(set(devices)) < len(devices):
    unique = list(dict.fromkeys(devices))
    device_of_cell = [unique.index(d) for d in devices]
  if example is not None:
    batch = p.input.batch_size
    input_bytes = _ExampleBytes(example[0], batch)
    target_bytes = _ExampleBytes(example[1], batch)
  else:  # From the model's input shape; targets are small next to it.
    model = p.task.model.Instantiate()
    input_bytes = cost_model.NumElements(model.InputShape(), 1) * (
        _DtypeSize(model.InputDtype()))
    target_bytes = 0.0
  return memory_model.StepConfig(
      schedule=pp.schedule, num_micro_batches=pp.num_micro_batches,
      batch_size=ReplicaBatchSize(p), remat_policy=pp.remat_policy,
      device_of_cell=device_of_cell, input_example_bytes=input_bytes,
      target_example_bytes=target_bytes)


def PredictPeaks(p, profiles, example=None):
  """Each device's memory_model.DevicePeak for the experiment's step."""
  return memory_model.PredictPeaks(profiles, StepConfig(p, example))


def BudgetLines(p, peaks, budget_mb=None, devices=None, headroom=0.0):
  """inspect_model's memory section: per device, prediction and budget.

    device    cells   predicted   budget   fits   largest moment
    /CPU:0    cell0     41.2 MiB   64 MiB   yes   B3.0: variables ...

  A device predicted within its budget but above (1 - headroom) of it is
  'tight': --plan=auto keeps that share free (--plan_headroom) because
  measured peaks have come out above the memory model's predictions.
  """
  header = (f'Predicted peak memory per device (memory model: one profiled '
            f'step per distinct cell; schedule={p.task.pipeline.schedule}, '
            f'M={p.task.pipeline.num_micro_batches}, '
            f'remat={p.task.pipeline.remat_policy})')
  lines = [header,
           f'{"device":<12} {"cells":<10} {"predicted":>11} {"budget":>9} '
           f'{"fits":>5}  at its peak']
  for peak in peaks:
    device = devices[peak.cells[0]] if devices else f'device {peak.device}'
    budget = f'{budget_mb} MiB' if budget_mb else '-'
    fits = ('-' if not budget_mb else
            'NO' if peak.peak_bytes > budget_mb * MIB else
            'tight' if peak.peak_bytes > (1 - headroom) * budget_mb * MIB
            else 'yes')
    cells = ','.join(f'cell{k}' for k in peak.cells)
    lines.append(f'{device:<12} {cells:<10} '
                 f'{peak.peak_bytes / MIB:>7.1f} MiB {budget:>9} {fits:>5}  '
                 f'{peak.Describe()}')
  if budget_mb and any(peak.peak_bytes > budget_mb * MIB for peak in peaks):
    lines.append(
        f'Some device does not fit its {budget_mb} MiB: raise '
        '--num_partitions or --num_micro_batches, use --remat_policy=always '
        'or --balance=memory, or let --plan=auto choose.')
  elif budget_mb and any(peak.peak_bytes > (1 - headroom) * budget_mb * MIB
                         for peak in peaks):
    lines.append(
        f'A tight device is predicted within its {budget_mb} MiB but in the '
        f'last {headroom:.0%} of it, which --plan=auto leaves free '
        '(--plan_headroom): measured peaks have come out above the '
        'prediction, so it may run out of memory.')
  return lines


def SmallestBudgetMb(peaks):
  """The smallest per-device memory, in whole MiB, that holds every peak."""
  return int(math.ceil(max(p.peak_bytes for p in peaks) / MIB))


def LayerCells(p):
  """Each layer of the experiment's model as a one-layer cell (the planner's
  unit)."""
  from tfpipe.gpipe import cell as cell_lib  # pylint: disable=g-import-not-at-top
  model = p.task.model.Instantiate()
  layers = partition.FlattenSequentialLayers(
      task_lib.SeededLayerParams(model, p.task.random_seed))
  return [cell_lib.FeatureExtractionLayer.Params().Set(name=f'layer{i}',
                                                       sub=[layer.Copy()])
          for i, layer in enumerate(layers)]


def PlannerProfiles(p, micro_batch_sizes, example=None, log=None,
                    intra_op_threads=0, device=None, in_subprocess=False,
                    single_threaded_calls=False):
  """gpipe.planner.LayerProfiles of the experiment's layers (profiled as
  ProfileRequest says, for devices of `single_threaded_calls`)."""
  from tfpipe.gpipe import planner  # pylint: disable=g-import-not-at-top
  request = ProfileRequest(p, cells=LayerCells(p),
                           micro_batch_sizes=micro_batch_sizes,
                           example=example, intra_op_threads=intra_op_threads,
                           single_threaded_calls=single_threaded_calls,
                           device=device, process_per_cell=False)
  profiles = Profile(request, log=log, in_subprocess=in_subprocess)
  return planner.LayerProfiles(profiles, profiles[-1])
