"""`--plan=auto`: the trainer asks gpipe.planner how to pipeline the experiment.

Before anything runs, the experiment's layers are profiled (one short step
per distinct layer, in a subprocess with a counting allocator; see
gpipe.memory_profile), the planner picks the fastest configuration whose
every device fits `--device_memory_mb`, the chosen cells are profiled as
cells to check it, in the remat modes the plan reads (the next best is
taken if they no longer fit, each cut profiled once), and the plan is
written into the params: task.pipeline.num_partitions, balance (the
layer counts of the cut), num_micro_batches, remat_policy, schedule and
num_replicas. The plan and why it was chosen are printed. If nothing
fits, the run stops there, naming the smallest per-device memory that
would fit.
"""

from tfpipe.gpipe import memory_model
from tfpipe.gpipe import memory_profile
from tfpipe.gpipe import planner
from tfpipe.trainer import memory_report

MIB = 2**20
# Distinct cells (a cut at a micro-batch size) profiled, best plan first,
# when the chosen cells profiled as cells no longer fit (the layers' sum is
# an estimate). The plans that share profiled cells (another schedule or
# remat policy) are re-predicted from them at no cost: the three fastest
# plans were once all one cut at M=2, and the run stopped although M=1 fit.
_MAX_REFINEMENTS = 3


def ProfiledSizes(batch_size, num_devices, max_micro_batches=64):
  """The micro-batch sizes to profile the layers at: the batch halved
  until the smallest size the planner considers.

  A plan's micro-batch size is the batch over R replicas and M micro-batches.
  M is a power of two, and so is R = devices // K for every K when the
  device count is a power of two up to 8; with a power-of-two batch these
  are then exactly the sizes the candidates run at (memory_model
  interpolates between them for any other). Profiling only the two ends
  drew a straight line between them, blind to where a device's kernels lose
  speed: on one CPU a 256-row matmul ran at half the speed per row of a
  384-row one, and the planner ranked first the M that was measured slowest
  (benchmarks/RESULTS.md, issue 23). Planning took 1.4-1.5x as long in the
  two cases measured: the compute is dominated by the largest sizes, and
  each size adds one trace per distinct layer.
  """
  smallest = max(1, batch_size // (num_devices * max_micro_batches))
  sizes, n = {smallest}, batch_size
  while n > smallest:
    sizes.add(n)
    n //= 2
  return sorted(sizes)


def _OnDeviceOrCpu(profile, device, log):
  """(profile(device), device), or (profile(None), None) with a line saying
  why when profiling on `device` fails."""
  if device is None:
    return profile(None), None
  try:
    return profile(device), device
  except RuntimeError as e:
    log(f'  Profiling the layers on {device} failed ({e}); profiling them '
        'on the CPU instead, whose memory and times may differ.')
    return profile(None), None


def ApplyPlan(p, plan):
  """Writes the plan into the experiment's pipeline params."""
  p.task.pipeline.Set(
      num_partitions=plan.num_partitions, balance=list(plan.layer_counts),
      num_micro_batches=plan.num_micro_batches,
      remat_policy=plan.remat_policy, schedule=plan.schedule,
      num_replicas=plan.num_replicas)


def Choose(p, devices, log=print, example=None, intra_op_threads=0,
           profile_device=None, single_threaded_calls=False,
           profile_runs=3):
  """Plans the experiment for `devices` (a planner.Devices); applies and
  returns the PipelinePlan.

  Runs no TensorFlow op in this process (profiles run in a subprocess,
  unless `example`, a numpy (inputs, targets) batch, is given and this
  process's allocator counts), so devices can still be set up after it.
  The profiles run with each device's `intra_op_threads` (0: TensorFlow's
  default), on `profile_device` if given: '/GPU:0' when the devices are
  this machine's GPUs, whose kernels' memory and time a CPU profile does
  not show. That profile runs in a subprocess, which gives the GPU back
  when it ends; if it fails, the layers are profiled on the CPU, and the
  log says so. `single_threaded_calls`: the devices are worker processes'
  CPUs (a cluster's), whose actions are calls on the single-threaded
  executor and whose allocators hold no build slack; the profiles then
  measure that too (memory_report.ProfileRequest), not a bigger working set
  that a plan would leave unused. `profile_runs`: the fresh processes
  that profile each mode of the chosen cut's cells
  (memory_report.ProfileRequest).

  Raises:
    planner.NoPlanError: nothing fits; its message names the smallest
      per-device memory that would.
  """
  batch_size = p.input.batch_size
  sizes = ProfiledSizes(batch_size, devices.count)
  log(f'Planning for {devices.count} device(s) of {devices.BudgetText()}: '
      'profiling the layers at '
      f'micro-batch sizes {sizes}...')
  profiles, profile_device = _OnDeviceOrCpu(
      lambda device: memory_report.PlannerProfiles(
          p, sizes, example, log=None, intra_op_threads=intra_op_threads,
          device=device, in_subprocess=device is not None,
          single_threaded_calls=single_threaded_calls),
      profile_device, log)
  step = memory_report.StepConfig(p, example)
  plans = planner.CandidatePlans(
      profiles, devices, batch_size,
      input_example_bytes=step.input_example_bytes,
      target_example_bytes=step.target_example_bytes)

  def ProfileCellsOf(plan, n, modes, joining):
    candidate = p.Copy()
    ApplyPlan(candidate, plan)
    cells, _ = _OnDeviceOrCpu(
        lambda device: memory_report.Profile(
            memory_report.ProfileRequest(
                candidate, micro_batch_sizes=n, example=example,
                intra_op_threads=intra_op_threads, device=device,
                single_threaded_calls=single_threaded_calls,
                allocator_slack=not joining, profile_runs=profile_runs,
                modes=modes),
            in_subprocess=device is not None),
        profile_device, log)
    return cells

  plan, refined = FirstThatFits(
      plans, batch_size, ProfileCellsOf,
      lambda plan, cells: planner.Refine(
          plan, cells, devices, batch_size, step.input_example_bytes,
          step.target_example_bytes),
      devices.BudgetText(), devices.memory_bytes, log)
  best = planner.Explain([refined] + [q for q in plans if q is not plan],
                         devices)
  ApplyPlan(p, best)
  log(best.Describe())
  return best


def FirstThatFits(plans, batch_size, profile_cells, refine, budget_text,
                  memory_bytes, log=print):
  """(plan, refined plan) of the first of `plans` (best first) that still
  fits once its cells are profiled as cells.

  A cut's cells are profiled in the remat modes its first plan reads
  (memory_report.RematModes); a later plan of that cut that reads another
  mode profiles only that one, which joins the first's profiles.

  Args:
    plans: planner.PipelinePlans, best first.
    batch_size: the global batch.
    profile_cells: (plan, micro-batch sizes, remat modes, whether they join
      profiles of the same cells, whose build slack they need not measure)
      -> its CellProfiles in those modes.
    refine: (plan, cell profiles) -> the re-predicted plan, or None when a
      device no longer fits (planner.Refine).
    budget_text, memory_bytes: the devices' budget, for the error.
    log: where the plans dropped are said.

  Raises:
    planner.NoPlanError: the plans of the first _MAX_REFINEMENTS distinct
      cuts (and micro-batch sizes) do not fit.
  """
  # (cut, replicas, micro-batch sizes) -> (remat modes, CellProfiles)
  cell_profiles = {}
  tried = 0
  for plan in plans:
    n = sorted(set(memory_model.MicroBatchSizes(
        batch_size // plan.num_replicas, plan.num_micro_batches)))
    key = (tuple(plan.layer_counts), plan.num_replicas, tuple(n))
    modes = memory_report.RematModes(plan.remat_policy,
                                     plan.num_micro_batches, step_time=True)
    if key not in cell_profiles:
      if len(cell_profiles) == _MAX_REFINEMENTS:
        break
      cell_profiles[key] = (set(modes), profile_cells(plan, n, modes, False))
    have, cells = cell_profiles[key]
    missing = tuple(mode for mode in modes if mode not in have)
    if missing:
      cells = [memory_profile.JoinModes(cell, more) for cell, more in zip(
          cells, profile_cells(plan, n, missing, True))]
      cell_profiles[key] = (have | set(missing), cells)
    tried += 1
    refined = refine(plan, cells)
    if refined is not None:
      return plan, refined
    log(f'  {plan.num_partitions} partition(s), M={plan.num_micro_batches}, '
        f'{plan.remat_policy}, {plan.schedule}: its cells, profiled as '
        'cells, do not fit; trying the next.')
  raise planner.NoPlanError(
      f'The {tried} fastest plans predicted to fit {budget_text} (their '
      f'{len(cell_profiles)} distinct cuts and micro-batch sizes) do not fit '
      'once their cells are profiled; give more memory or devices.',
      memory_bytes)
