"""Peak memory of each pipeline device, for progress lines and TensorBoard.

A pipeline exists to spread a model over several accelerators' memories, so
the trainer shows where memory lands: at every progress line, the peak each
device's allocator reached since the previous line
(`tf.config.experimental.get_memory_info`, then `reset_memory_stats`).

Each GPU has its own allocator and its own entry, `peak_mem[GPU:k]`. The
logical CPU devices that tests and CPU runs use share ONE allocator, so a CPU
run has a single entry, `peak_mem[CPU]`, for all of them; it cannot show how
memory splits between cells. TensorFlow's default CPU allocator answers the
query but counts almost nothing (a training step of the tiny LM reads 0
bytes), so the CPU is reported only with the BFC allocator, which
TF_CPU_ALLOCATOR_USE_BFC=true selects when set before TensorFlow starts.
Devices that keep no statistics, and remote devices (a multi-host
controller's workers), add nothing.
"""

import tensorflow as tf

from tfpipe import device_names
from tfpipe import memory_limit


def _Query(name):
  """get_memory_info(name), or None if the device keeps no statistics."""
  try:
    return tf.config.experimental.get_memory_info(name)
  except (ValueError, tf.errors.OpError):
    return None


def MemoryDevices(devices):
  """[(label, device name)] of the devices whose allocators report memory.

  Args:
    devices: the pipeline's device names ('/GPU:0', '/CPU:3', ...).

  Returns:
    One entry per allocator, in the devices' order: ('GPU:k', 'GPU:k') per
    GPU and ('CPU', 'CPU:0') once for all CPU devices.
  """
  result = []
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    if spec.job not in (None, 'localhost'):
      continue  # A remote device: its allocator is in another process.
    device_type = (spec.device_type or 'CPU').upper()
    if device_type == 'CPU':
      if not memory_limit.UsesBfc():
        continue
      label, name = 'CPU', 'CPU:0'
    else:
      label = name = device_names.AllocatorName(device)
    if (label, name) not in result and _Query(name) is not None:
      result.append((label, name))
  return result


def FormatBytes(num_bytes):
  """'1.25GiB', '310.4MiB', '12.0KiB' or '512B'."""
  for unit, size in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if num_bytes >= size:
      return f'{num_bytes / size:.{2 if unit == "GiB" else 1}f}{unit}'
  return f'{int(num_bytes)}B'


class PeakMemory:
  """Peak bytes per allocator since the last `PeaksAndReset()`."""

  def __init__(self, devices):
    self.devices = MemoryDevices(devices)
    self.Reset()

  def Reset(self):
    for _, name in self.devices:
      try:
        tf.config.experimental.reset_memory_stats(name)
      except (ValueError, tf.errors.OpError):
        pass

  def PeaksAndReset(self):
    """{label: peak bytes} since the previous call; starts a new interval."""
    peaks = {}
    for label, name in self.devices:
      info = _Query(name)
      if info is not None:
        peaks[label] = int(info['peak'])
    self.Reset()
    return peaks


def FormatPeaks(peaks):
  """'peak_mem[GPU:0]=1.25GiB peak_mem[GPU:1]=...' ('' without devices)."""
  return ' '.join(f'peak_mem[{label}]={FormatBytes(value)}'
                  for label, value in peaks.items())


def SummaryScalars(peaks):
  """TensorBoard scalars: memory/peak_bytes/GPU_0, memory/peak_bytes/CPU."""
  return {f'memory/peak_bytes/{label.replace(":", "_")}': float(value)
          for label, value in peaks.items()}
