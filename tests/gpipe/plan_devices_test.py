"""Tests of gpipe.plan_devices: what the planner plans for.

Protected properties: a headroom leaves that share of each device's memory
out of what a plan may fill, and the memory that holds a peak counts it; a
headroom outside [0, 1) is refused, naming it; worker processes on one host
compute as many at a time as its cores allow; remote workers pay the
controller's per-step calls and each transfer's latency, more with more
workers, and send at loopback speed on the controller's host.
"""

import pytest

from tfpipe.gpipe import plan_devices

MIB = 2**20


def test_a_headroom_is_kept_out_of_what_a_plan_may_fill():
  devices = plan_devices.Devices(count=2, memory_bytes=40 * MIB,
                                 headroom=0.25)
  assert devices.plannable_bytes == 30 * MIB
  assert devices.MemoryNeeded(30 * MIB) == 40 * MIB
  assert devices.BudgetText() == '30.0 MiB (40 MiB less a 25% headroom)'
  exact = plan_devices.Devices(count=2, memory_bytes=40 * MIB)
  assert exact.plannable_bytes == exact.MemoryNeeded(40 * MIB) == 40 * MIB
  assert exact.BudgetText() == '40 MiB'


@pytest.mark.parametrize('headroom', [-0.1, 1.0, 2])
def test_a_headroom_outside_0_to_1_is_refused(headroom):
  with pytest.raises(ValueError, match=r'Devices.headroom=.*at least 0 and '
                     r'below 1'):
    plan_devices.Devices(count=2, memory_bytes=MIB, headroom=headroom)


def test_host_computing_at_once_is_its_cores_over_each_workers_threads():
  assert plan_devices.HostComputingAtOnce(intra_op_threads=1, cores=2) == 2
  assert plan_devices.HostComputingAtOnce(intra_op_threads=0, cores=2) == 1
  assert plan_devices.HostComputingAtOnce(intra_op_threads=4, cores=2) == 1
  assert plan_devices.HostComputingAtOnce(intra_op_threads=2, cores=16) == 8


def test_remote_workers_pay_per_step_and_per_transfer():
  local = plan_devices.Devices(2, 1e12)
  remote = plan_devices.RemoteWorkers(local)
  assert remote.step_call_s > 2 * plan_devices.REMOTE_STEP_FUNCTION_CALL_S
  assert remote.latency_s == plan_devices.REMOTE_TRANSFER_LATENCY_S
  # A step spanning more workers costs the controller more; idle ones
  # cost nothing.
  assert remote.StepCallSeconds(3) > remote.StepCallSeconds(2) > (
      remote.StepCallSeconds(1)) == remote.step_call_s
  more = plan_devices.RemoteWorkers(plan_devices.Devices(4, 1e12))
  assert more.StepCallSeconds(2) == remote.StepCallSeconds(2)
  assert remote.bandwidth_bytes_per_s is None
  assert plan_devices.RemoteWorkers(
      local, same_host=True).bandwidth_bytes_per_s == (
          plan_devices.LOOPBACK_BANDWIDTH_BYTES_PER_S)
  # The headroom and the memory travel with the devices.
  capped = plan_devices.Devices(2, 64 * MIB, headroom=0.15)
  assert plan_devices.RemoteWorkers(capped).plannable_bytes == (
      capped.plannable_bytes)
