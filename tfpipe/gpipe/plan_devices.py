"""What the planner plans for: the devices, and what driving them costs.

A plan is only as good as its picture of the hardware: how many devices,
each one's memory and how much of it a plan may fill (`Devices.headroom`:
the memory model is a prediction, and an allocator counts more than the
tensors' bytes), the links between neighbours, whether the devices compute
at the same time, and the fixed costs a controller pays to drive worker
processes over gRPC (measured by benchmarks/remote_action_costs.py and
benchmarks/planner_check.py). gpipe.planner takes a `Devices`.
"""

import dataclasses
import os
from typing import Optional

MIB = 2.0**20


@dataclasses.dataclass
class Devices:
  """What the planner may use.

  Attributes:
    count: devices available.
    memory_bytes: each device's memory budget.
    bandwidth_bytes_per_s: between neighbouring devices; None: transfers
      are free.
    latency_s: fixed cost of one transfer.
    concurrent: whether the devices compute at the same time
      (accelerators, and CPU worker processes with either executor); False
      for logical CPU devices of one process, which share its threads.
    step_call_s: the controller's fixed cost per step: its own work (the
      batch in, the loss out) and calling the step function over the
      devices and the update (RemoteWorkers sets it for worker processes).
    step_per_device_s: what each device a step spans beyond the first adds
      to step_call_s; a plan's cells x replicas are spanned, not idle
      devices.
    computing_at_once: of concurrent devices, how many can compute at the
      same time (None: all). Worker processes on one host share its cores:
      `HostComputingAtOnce` of them run at once and the others wait.
    headroom: the fraction of each device's memory a plan leaves free; a
      plan's every predicted peak is within `plannable_bytes`. The memory
      model is a prediction: measured peaks have come out 3-7% above it
      (GPipe Table 1's pipeline-8 on CPU workers, --plan=auto on logical
      GPUs) and, where an allocator's chunk rounding or a kernel's scratch
      was not seen by the profile, up to 20% and more
      (benchmarks/RESULTS.md). 0 plans to the last byte; the trainer's
      --plan_headroom defaults to 0.15, the memory model's accuracy bar.
  """
  count: int
  memory_bytes: float
  bandwidth_bytes_per_s: Optional[float] = None
  latency_s: float = 0.0
  concurrent: bool = True
  step_call_s: float = 0.0
  step_per_device_s: float = 0.0
  computing_at_once: Optional[int] = None
  headroom: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.headroom < 1.0:
      raise ValueError(
          f'Devices.headroom={self.headroom!r}: give the fraction of each '
          "device's memory to leave free, at least 0 and below 1 (e.g. 0.15).")

  @property
  def plannable_bytes(self):
    """What a plan's predicted peak may reach on each device."""
    return self.memory_bytes * (1.0 - self.headroom)

  def BudgetText(self):
    """Each device's budget in words: '25 MiB', or '21.2 MiB (25 MiB less a
    15% headroom)'."""
    if not self.headroom:
      return f'{self.memory_bytes / MIB:.0f} MiB'
    return (f'{self.plannable_bytes / MIB:.1f} MiB '
            f'({self.memory_bytes / MIB:.0f} MiB less a {self.headroom:.0%} '
            'headroom)')

  def MemoryNeeded(self, peak_bytes):
    """The per-device memory whose plannable part holds `peak_bytes`."""
    return peak_bytes / (1.0 - self.headroom)

  def StepCallSeconds(self, devices_spanned):
    """The controller's fixed cost of a step over `devices_spanned`."""
    return self.step_call_s + self.step_per_device_s * max(
        0, devices_spanned - 1)


def HostComputingAtOnce(intra_op_threads=0, cores=None):
  """How many worker processes of this host compute at the same time: its
  cores over each one's intra-op threads (0: TensorFlow's default, one per
  core), at least one."""
  if cores is None:
    cores = len(os.sched_getaffinity(0)) if hasattr(
        os, 'sched_getaffinity') else (os.cpu_count() or 1)
  return max(1, cores // (intra_op_threads or cores))


# What driving worker processes from a controller costs, beyond compute
# (benchmarks/remote_action_costs.py; benchmarks/RESULTS.md, "Issue 23"):
# one call of a function over the workers, and one activation or gradient
# handed from worker to worker by send/recv inside a step, at loopback speed
# on one host (1 to 8 MiB in 0.74 to 5.2 ms: about 0.3 ms and 1.5 GB/s;
# more micro-batches, so more transfers, did not lengthen a step of a model
# of negligible compute).
REMOTE_STEP_FUNCTION_CALL_S = 3e-3
REMOTE_TRANSFER_LATENCY_S = 0.3e-3
LOOPBACK_BANDWIDTH_BYTES_PER_S = 1.5e9
# The trainer's own work per step on worker processes, beyond the two calls
# (benchmarks/RESULTS.md, "planner_check.py": a model of negligible compute
# on the launcher's workers, 1 to 4 partitions and 2 x 2, whose measured
# steps include the two calls): the batch sent to the first worker, the
# loss and gradient norm read back, the step counter; and what each further
# worker the step spans adds beyond its boundary's two transfers (idle
# workers add nothing).
REMOTE_TRAINER_STEP_S = 12e-3
REMOTE_STEP_PER_WORKER_S = 2.5e-3


def RemoteWorkers(devices, same_host=False):
  """`devices` as worker processes driven by a controller over gRPC: each
  step pays the trainer's per-step work and two function calls (the step
  and the update), plus some for each further worker it spans, and each
  transfer between neighbours the send/recv latency; workers on the
  controller's host (`same_host`) send at loopback speed unless a bandwidth
  is given."""
  per_step = REMOTE_TRAINER_STEP_S + 2 * REMOTE_STEP_FUNCTION_CALL_S
  bandwidth = devices.bandwidth_bytes_per_s
  if same_host and not bandwidth:
    bandwidth = LOOPBACK_BANDWIDTH_BYTES_PER_S
  return dataclasses.replace(
      devices, latency_s=max(devices.latency_s, REMOTE_TRANSFER_LATENCY_S),
      step_call_s=max(devices.step_call_s, per_step),
      step_per_device_s=max(devices.step_per_device_s,
                            REMOTE_STEP_PER_WORKER_S),
      bandwidth_bytes_per_s=bandwidth)
