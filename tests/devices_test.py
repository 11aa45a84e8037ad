"""Tests of tfpipe.devices: how local devices are split into logical ones.

No GPU is needed. The split decision (PlanSplit) is pure and tested on the
cases a user meets (one GPU and two partitions, more GPUs than needed, a
memory flag too big for the GPU). The CPU path runs for real in a fresh
process, since logical devices can only be made before TensorFlow starts.
The GPU path runs the real module against a stand-in for `tf.config` with
one physical GPU, which records the configuration calls TensorFlow would
receive.
"""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tfpipe import devices
from tfpipe import quiet

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_H100_MB = 81559


def test_one_gpu_two_partitions_is_split_in_two_even_halves():
  split = devices.PlanSplit('GPU', 1, 2, physical_memory_mb=_H100_MB,
                            memory_source='from the CUDA driver')
  assert split.counts == (2,)
  reserved = max(devices.RESERVED_MIN_MB,
                 int(_H100_MB * devices.RESERVED_FRACTION))
  assert split.memory_limit_mb == (_H100_MB - reserved) // 2
  assert split.num_logical == 2 and split.is_split
  assert split.Describe('task.pipeline.num_partitions x num_replicas = 2') == (
      f'Split GPU:0 into 2 logical GPUs of {split.memory_limit_mb} MiB each '
      '(task.pipeline.num_partitions x num_replicas = 2; memory: 81559 MiB '
      f'per GPU from the CUDA driver, less {reserved} MiB kept free, shared '
      'evenly; memory_limit_mb sets it).')


def test_logical_gpus_never_take_more_than_the_gpu_has():
  for needed in (2, 3, 4, 8):
    split = devices.PlanSplit('GPU', 1, needed, physical_memory_mb=16384)
    assert split.memory_limit_mb * needed < 16384


def test_enough_gpus_are_used_whole_and_the_rest_hidden():
  split = devices.PlanSplit('GPU', 8, 2, physical_memory_mb=_H100_MB)
  assert split.counts == (1, 1)
  assert split.memory_limit_mb is None and not split.is_split
  assert split.Describe('--num_devices=2') == (
      'Using GPU:0 and GPU:1 (--num_devices=2).')


def test_uneven_split_over_two_gpus_gives_equal_memory():
  split = devices.PlanSplit('GPU', 2, 3, physical_memory_mb=40000)
  assert split.counts == (2, 1)
  assert split.memory_limit_mb == (40000 - devices.RESERVED_MIN_MB) // 2
  assert '3 logical GPUs (2, 1 per GPU)' in split.Describe()


def test_memory_flag_is_used_as_given_and_named_when_too_big():
  split = devices.PlanSplit('GPU', 1, 8, physical_memory_mb=_H100_MB,
                            memory_limit_mb=8192, memory_name='--budget_mib')
  assert split.counts == (8,) and split.memory_limit_mb == 8192
  assert 'memory: set by --budget_mib' in split.Describe()
  with pytest.raises(ValueError, match=r'--budget_mib=12000 x 8 logical GPUs '
                     r'per GPU = 96000 MiB, more than the 81559 MiB'):
    devices.PlanSplit('GPU', 1, 8, physical_memory_mb=_H100_MB,
                      memory_limit_mb=12000, memory_name='--budget_mib')


def test_a_memory_limit_caps_a_whole_gpu():
  split = devices.PlanSplit('GPU', 1, 1, physical_memory_mb=_H100_MB,
                            memory_limit_mb=8192)
  assert split.counts == (1,) and split.memory_limit_mb == 8192
  assert split.Describe().startswith('Using GPU:0 with a limit of 8192 MiB')


def test_unknown_gpu_memory_assumes_a_small_gpu_and_says_so():
  split = devices.PlanSplit('GPU', 1, 2, physical_memory_mb=None,
                            memory_name='--logical_gpu_memory_mb')
  usable = devices.UsableGpuMemoryMb(devices.FALLBACK_GPU_MEMORY_MB)
  assert split.memory_limit_mb == usable // 2
  assert (f'memory: unknown, {devices.FALLBACK_GPU_MEMORY_MB} MiB per GPU '
          'assumed' in split.Describe())
  assert '--logical_gpu_memory_mb sets it' in split.Describe()


def test_cpu_is_one_device_split_in_as_many_as_needed():
  split = devices.PlanSplit('CPU', 1, 5)
  assert split.counts == (5,) and split.memory_limit_mb is None
  assert split.Describe() == 'Split the CPU into 5 logical devices.'


@pytest.mark.parametrize('args, message', [
    (('GPU', 0, 2), r'No GPU is visible'),
    (('GPU', 1, 0), r'0 devices asked for; ask for at least 1'),
    (('TPU', 1, 2), r"device_type='TPU'"),
    (('GPU', 1, 64, 8000), r'64 logical GPUs per GPU would get \d+ MiB.*'
     r'ask for fewer logical devices, or set memory_limit_mb'),
])
def test_impossible_splits_say_why(args, message):
  with pytest.raises(ValueError, match=message):
    devices.PlanSplit(*args)


def test_memory_limit_on_the_cpu_is_refused():
  with pytest.raises(ValueError, match=r'--logical_gpu_memory_mb=100 sets the '
                     r'memory of logical GPUs, but this run is on the CPU'):
    devices.PlanSplit('CPU', 1, 2, memory_limit_mb=100,
                      memory_name='--logical_gpu_memory_mb')


@pytest.mark.parametrize('name, mb', [
    ('NVIDIA H100 80GB HBM3', 80 * 10**9 // 2**20),
    ('NVIDIA A100-SXM4-40GB', 40 * 10**9 // 2**20),
    ('NVIDIA L4', None), (None, None)])
def test_memory_from_device_name(name, mb):
  assert devices.MemoryFromDeviceName(name) == mb


_CPU_PROBE = r'''
import json
from tfpipe import devices, quiet
tf = quiet.ImportTensorFlow()
out = {'three': devices.EnsureLogicalDevices(3, 'CPU'),
       'two_of_them': devices.EnsureLogicalDevices(2)}
try:
  devices.EnsureLogicalDevices(5, 'CPU')
except ValueError as e:
  out['five'] = str(e)
try:
  devices.SplitLocalDevices('CPU', 4)
except ValueError as e:
  out['split_after_start'] = str(e)
out['kept'] = devices.SplitLocalDevices('CPU', 2)[0] is None
print('PROBE ' + json.dumps(out))
'''


def _Probe(script):
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  proc = subprocess.run([sys.executable, '-c', script], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith('PROBE ')]
  return json.loads(line[0][len('PROBE '):]), proc


def test_cpu_split_for_real_before_tensorflow_starts_and_after():
  out, proc = _Probe(_CPU_PROBE)
  assert out['three'] == [f'/device:CPU:{i}' for i in range(3)]
  assert out['two_of_them'] == ['/device:CPU:0', '/device:CPU:1']
  assert out['five'].startswith(
      '5 CPU devices are needed but TensorFlow has already started with 3 '
      '(/device:CPU:0, /device:CPU:1, /device:CPU:2)')
  assert 'tfpipe.devices.EnsureLogicalDevices(5) before' in out['five']
  assert out['split_after_start'].startswith('4 CPU devices are needed')
  assert out['kept']
  assert 'oneDNN' not in proc.stderr and 'absl::' not in proc.stderr


class _FakeConfig:
  """tf.config with physical GPUs, recording what would configure them.

  Everything else (the decision, the arguments built) is the real module's.
  """

  def __init__(self, num_gpus=1, device_name='NVIDIA H100 80GB HBM3',
               started=False):
    self.gpus = [tf.config.PhysicalDevice(f'/physical_device:GPU:{i}', 'GPU')
                 for i in range(num_gpus)]
    self.visible = list(self.gpus)
    self.logical = {}
    self.calls = []
    self.started = started
    self.device_name = device_name
    self.experimental = self

  def get_device_details(self, device):
    return {'device_name': self.device_name} if device in self.gpus else {}

  def list_physical_devices(self, device_type=None):
    return list(self.gpus) if device_type == 'GPU' else [
        tf.config.PhysicalDevice('/physical_device:CPU:0', 'CPU')]

  def get_visible_devices(self, device_type):
    assert device_type == 'GPU'
    return list(self.visible)

  def set_visible_devices(self, devices_, device_type):
    self.calls.append(('set_visible_devices', list(devices_), device_type))
    if self.started:
      raise RuntimeError('Visible devices cannot be modified after being '
                         'initialized')
    self.visible = list(devices_)

  def get_logical_device_configuration(self, device):
    return self.logical.get(device)

  def set_logical_device_configuration(self, device, logical):
    self.calls.append(('set_logical_device_configuration', device,
                       list(logical)))
    if self.started:
      raise RuntimeError('Virtual devices cannot be modified after being '
                         'initialized')
    self.logical[device] = list(logical)

  def list_logical_devices(self, device_type):
    self.started = True
    if device_type != 'GPU':
      return []
    count = sum(len(self.logical.get(g) or [None]) for g in self.visible)
    return [tf.config.LogicalDevice(f'/device:GPU:{i}', 'GPU')
            for i in range(count)]


@pytest.fixture
def fake_gpu(monkeypatch):
  """One physical H100 whose memory the driver does not report."""
  config = _FakeConfig()
  monkeypatch.setattr(devices, '_Config', lambda: config)
  monkeypatch.setattr(devices, 'CudaTotalMemoryMb', lambda n: None)
  return config


def test_gpu_split_calls_tensorflow_with_the_planned_limits(fake_gpu):
  split, names = devices.SplitLocalDevices('GPU', 2)
  gpu = fake_gpu.gpus[0]
  total = devices.MemoryFromDeviceName('NVIDIA H100 80GB HBM3')
  each = devices.UsableGpuMemoryMb(total) // 2
  assert split.memory_limit_mb == each
  assert fake_gpu.calls == [
      ('set_visible_devices', [gpu], 'GPU'),
      ('set_logical_device_configuration', gpu,
       [tf.config.LogicalDeviceConfiguration(memory_limit=each)] * 2)]
  assert names == ['/device:GPU:0', '/device:GPU:1']
  assert "from its name 'NVIDIA H100 80GB HBM3'" in split.Describe()


def test_gpu_memory_from_the_driver_wins_over_the_name(fake_gpu,
                                                       monkeypatch):
  monkeypatch.setattr(devices, 'CudaTotalMemoryMb', lambda n: _H100_MB)
  split, _ = devices.SplitLocalDevices('GPU', 4)
  assert split.memory_limit_mb == devices.UsableGpuMemoryMb(_H100_MB) // 4
  assert '81559 MiB per GPU from the CUDA driver' in split.Describe()


def test_ensure_uses_configured_devices_and_explains_when_too_late(fake_gpu):
  assert devices.EnsureLogicalDevices(1) == ['/device:GPU:0']
  assert fake_gpu.calls == []  # One GPU is one device: nothing to split.
  with pytest.raises(ValueError, match=r'^3 GPU devices are needed but '
                     r'TensorFlow has already started with 1 \(/device:GPU:0\)'
                     r'.*EnsureLogicalDevices\(3\)'):
    devices.EnsureLogicalDevices(3)


def test_ensure_splits_before_start_and_logs_one_line(fake_gpu):
  lines = []
  names = devices.EnsureLogicalDevices(4, log=lines.append)
  assert names == [f'/device:GPU:{i}' for i in range(4)]
  assert len(lines) == 1 and lines[0].startswith(
      'Split GPU:0 into 4 logical GPUs of ')


def test_cpu_choice_hides_the_gpus(fake_gpu):
  assert devices.ChooseDeviceType('cpu') == 'CPU'
  assert fake_gpu.calls == [('set_visible_devices', [], 'GPU')]
  assert devices.ChooseDeviceType('auto') == 'CPU'


def test_auto_and_gpu_choose_a_visible_gpu(fake_gpu):
  assert devices.ChooseDeviceType('auto') == 'GPU'
  assert devices.ChooseDeviceType('gpu') == 'GPU'
  assert fake_gpu.calls == []


def test_gpu_asked_for_without_one_quotes_tensorflows_reason(monkeypatch):
  monkeypatch.setattr(devices, '_Config', lambda: _FakeConfig(num_gpus=0))
  monkeypatch.setattr(quiet, '_startup_log', [
      'I0000 00:00:1.5   7 port.cc:153] oneDNN custom operations are on.',
      'E0000 00:00:1.6   7 cuda_platform.cc:52] failed call to cuInit: '
      'UNKNOWN ERROR (303)'])
  with pytest.raises(ValueError, match=r'^--device=gpu but no GPU is visible; '
                     r'use --device=cpu.*TensorFlow said: failed call to '
                     r'cuInit: UNKNOWN ERROR \(303\)\.$'):
    devices.ChooseDeviceType('gpu', flag='--device')
