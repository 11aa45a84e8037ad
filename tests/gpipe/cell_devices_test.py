"""Device checks: each bad list fails before any cell is built, naming the fix."""

import os
import subprocess
import sys
import textwrap

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


def test_devices_none_splits_the_device_before_tensorflow_starts():
  """As documented: with one device and K=2, the default splits it in two.

  Run in a fresh process: the test process has long started TensorFlow
  (tests/conftest.py split its CPU already).
  """
  code = textwrap.dedent('''
      from tfpipe import gpipe, layers
      params = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dims=4,
                                            output_dims=4) for i in range(2)]
      cells = gpipe.PartitionSequentialLayers(params, 2, balance=[1, 1])
      pipe = gpipe.PipeliningLayer.Params().Set(
          name='pipe', cell_tpl=cells, num_micro_batches=2).Instantiate()
      print('DEVICES', pipe.cell_devices)
  ''')
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', CUDA_VISIBLE_DEVICES='')
  proc = subprocess.run([sys.executable, '-c', code], env=env, text=True,
                        capture_output=True, timeout=120, check=False,
                        cwd=os.path.dirname(os.path.dirname(
                            os.path.dirname(os.path.abspath(__file__)))))
  assert proc.returncode == 0, proc.stderr[-2000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith('DEVICES')][0]
  devices = eval(line[len('DEVICES'):])  # pylint: disable=eval-used
  assert len(devices) == 2 and len(set(devices)) == 2, devices
