"""Device checks: each bad list fails before any cell is built, naming the fix."""

import pytest

from tfpipe.gpipe import cell_devices


def test_listed_devices_are_kept_in_order():
  assert cell_devices.ResolveDevices(['/CPU:1', '/CPU:0'], 2) == [
      '/CPU:1', '/CPU:0']


def test_default_devices_are_the_logical_cpus():
  # tests/conftest.py splits the CPU into 8 logical devices.
  devices = cell_devices.ResolveDevices(None, 3)
  assert len(devices) == 3 and len(set(devices)) == 3
  assert all('CPU' in d for d in devices)


def test_unknown_device_is_named_with_what_exists():
  with pytest.raises(ValueError, match=r"unknown device '/GPU:7'.*Available"):
    cell_devices.ResolveDevices(['/CPU:0', '/GPU:7'], 2)


def test_unparsable_device_is_named():
  with pytest.raises(ValueError, match="cannot parse device name 'CPU zero'"):
    cell_devices.ResolveDevices(['CPU zero'], 1)


def test_empty_list_is_refused():
  with pytest.raises(ValueError, match='devices is empty'):
    cell_devices.ResolveDevices([], 1)


def test_fewer_devices_than_cells_suggests_round_robin():
  with pytest.raises(ValueError, match='round_robin_placement=True'):
    cell_devices.ResolveDevices(['/CPU:0'], 2)
  assert cell_devices.ResolveDevices(['/CPU:0', '/CPU:1'], 3, True) == [
      '/CPU:0', '/CPU:1', '/CPU:0']
