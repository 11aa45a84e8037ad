"""Local devices: choosing GPU or CPU, and splitting them into logical devices.

A pipeline of K partitions x R replicas runs on K*R devices, and the most
common machines have fewer: one GPU, or one CPU. TensorFlow splits a
physical device into logical ones (`tf.config.set_logical_device_configuration`),
but only before its runtime starts, and a logical GPU needs a memory limit.
This module decides the split (`PlanSplit`, a pure function) and applies it:

  SplitLocalDevices(device_type, n)  for programs that own start-up (the
      trainer, the benchmarks): split now, and say what was done.
  EnsureLogicalDevices(n)  for library code that needs n devices (a
      pipeline's default devices): uses what exists if it is enough,
      splits if TensorFlow has not started, and otherwise raises one
      ValueError saying how to get more.

Logical GPUs of one GPU each have their own allocator with a hard limit and
their own streams, so memory lands per device as on separate GPUs; they
share the GPU's compute, so they show placement and memory, not speed-up.

A logical GPU's memory, unless given: the smallest GPU's total memory (from
the CUDA driver; else from a size in its name, "NVIDIA H100 80GB HBM3"; else
an assumed FALLBACK_GPU_MEMORY_MB), less what CUDA, cuDNN and TensorFlow's
own reserve need (RESERVED_FRACTION of it, at least RESERVED_MIN_MB),
shared evenly by the logical GPUs of one GPU. The line `Split.Describe`
writes says which of these it used.

TensorFlow is imported only inside the functions that need it.
"""

import ctypes
import dataclasses
import re
from typing import Optional, Tuple

# Assumed total memory of a GPU whose size nothing reports: small enough to
# fit any GPU still in use for training.
FALLBACK_GPU_MEMORY_MB = 8192
# Kept free of logical GPUs: the CUDA context, cuDNN/cuBLAS workspaces and
# TensorFlow's own reserve (it keeps 1.5 GiB on recent GPUs).
RESERVED_FRACTION = 0.05
RESERVED_MIN_MB = 2048
# Smallest logical GPU worth making.
MIN_LOGICAL_GPU_MB = 256

DEVICE_TYPES = ('GPU', 'CPU')


@dataclasses.dataclass(frozen=True)
class Split:
  """How the physical devices of one type become logical devices.

  Attributes:
    device_type: 'GPU' or 'CPU'.
    counts: logical devices on each physical device used, in order; the
      physical devices after len(counts) are not used (GPUs are hidden).
    memory_limit_mb: memory of each logical GPU; None: no limit (the CPU,
      or whole GPUs).
    memory_note: how memory_limit_mb was chosen, for Describe.
  """
  device_type: str
  counts: Tuple[int, ...]
  memory_limit_mb: Optional[int] = None
  memory_note: str = ''

  @property
  def num_logical(self):
    return sum(self.counts)

  @property
  def is_split(self):
    """True if any physical device holds more than one logical device."""
    return max(self.counts) > 1

  def Describe(self, why=''):
    """One line saying what was done, e.g. for the trainer to print.

    Args:
      why: what asked for this many devices, e.g. '--num_devices=4'.
    """
    details = '; '.join(x for x in (why, self.memory_note) if x)
    details = f' ({details})' if details else ''
    if self.device_type == 'CPU':
      return (f'Split the CPU into {self.num_logical} logical devices'
              f'{details}.')
    gpus = _GpuList(len(self.counts))
    if self.memory_limit_mb is None:
      return f'Using {gpus}{details}.'
    if not self.is_split:
      return (f'Using {gpus} with a limit of {self.memory_limit_mb} MiB each'
              f'{details}.')
    uneven = ('' if len(set(self.counts)) == 1 else
              f' ({", ".join(map(str, self.counts))} per GPU)')
    return (f'Split {gpus} into {self.num_logical} logical GPUs{uneven} of '
            f'{self.memory_limit_mb} MiB each{details}.')


def _GpuList(n):
  names = [f'GPU:{i}' for i in range(n)]
  if n <= 2:
    return ' and '.join(names)
  return f'GPU:0-{n - 1}'


def UsableGpuMemoryMb(total_mb):
  """What logical GPUs may share of a GPU of `total_mb` MiB."""
  reserved = max(RESERVED_MIN_MB, int(total_mb * RESERVED_FRACTION))
  return total_mb - reserved


def PlanSplit(device_type, num_physical, num_needed, physical_memory_mb=None,
              memory_limit_mb=None, memory_source='',
              memory_name='memory_limit_mb'):
  """Decides how `num_physical` devices become `num_needed` logical ones.

  The CPU is one physical device split into num_needed. GPUs: the first
  min(num_physical, num_needed) are used, each holding an even share of the
  logical GPUs (the first ones one more when it does not divide). GPUs are
  split, with equal memory limits, only when there are fewer than needed,
  or when memory_limit_mb is given (a GPU then holds one limited device).

  Args:
    device_type: 'GPU' or 'CPU'.
    num_physical: physical devices of that type that are visible.
    num_needed: logical devices wanted.
    physical_memory_mb: total memory of the smallest GPU used; None if
      unknown (FALLBACK_GPU_MEMORY_MB is assumed when a split needs it).
    memory_limit_mb: memory of each logical GPU; None: shared evenly.
    memory_source: where physical_memory_mb came from, for the note.
    memory_name: how the caller's user sets memory_limit_mb (a flag), used
      in errors and in the note.

  Returns:
    A Split.

  Raises:
    ValueError: naming the bad argument and what would fix it.
  """
  device_type = str(device_type).upper()
  if device_type not in DEVICE_TYPES:
    raise ValueError(f'device_type={device_type!r}; expected one of '
                     f'{DEVICE_TYPES}.')
  if not isinstance(num_needed, int) or num_needed < 1:
    raise ValueError(f'{num_needed!r} devices asked for; ask for at least 1.')
  if num_physical < 1:
    raise ValueError(f'No {device_type} is visible, so {num_needed} logical '
                     f'{device_type} devices cannot be made.')
  if device_type == 'CPU':
    if memory_limit_mb is not None:
      raise ValueError(f'{memory_name}={memory_limit_mb} sets the memory of '
                       'logical GPUs, but this run is on the CPU; leave it '
                       'unset or run on a GPU.')
    return Split('CPU', (num_needed,))
  used = min(num_physical, num_needed)
  counts = tuple(num_needed // used + (1 if i < num_needed % used else 0)
                 for i in range(used))
  per_gpu = max(counts)
  if memory_limit_mb is not None:
    if memory_limit_mb < 1:
      raise ValueError(f'{memory_name}={memory_limit_mb}; give at least 1 '
                       'MiB.')
    if (physical_memory_mb is not None and
        memory_limit_mb * per_gpu > physical_memory_mb):
      raise ValueError(
          f'{memory_name}={memory_limit_mb} x {per_gpu} logical GPUs per GPU '
          f'= {memory_limit_mb * per_gpu} MiB, more than the '
          f'{physical_memory_mb} MiB a GPU has'
          f'{f" ({memory_source})" if memory_source else ""}. '
          f'Lower {memory_name}, or ask for fewer logical devices.')
    return Split('GPU', counts, memory_limit_mb,
                 f'memory: set by {memory_name}')
  if per_gpu == 1:
    return Split('GPU', counts)
  if physical_memory_mb is None:
    total, note = FALLBACK_GPU_MEMORY_MB, (
        f'memory: unknown, {FALLBACK_GPU_MEMORY_MB} MiB per GPU assumed')
  else:
    total, note = physical_memory_mb, (
        f'memory: {physical_memory_mb} MiB per GPU{_Source(memory_source)}')
  usable = UsableGpuMemoryMb(total)
  each = usable // per_gpu
  if each < MIN_LOGICAL_GPU_MB:
    raise ValueError(
        f'{per_gpu} logical GPUs per GPU would get {each} MiB each of '
        f'{usable} usable MiB ({note}); ask for fewer logical devices, or '
        f'set {memory_name}.')
  note += (f', less {total - usable} MiB kept free, shared evenly; '
           f'{memory_name} sets it')
  return Split('GPU', counts, each, note)


def _Source(source):
  return f' {source}' if source else ''


def CudaTotalMemoryMb(num_devices):
  """Smallest total memory of CUDA devices 0..num_devices-1, from the driver.

  Returns None where there is no CUDA driver (libcuda) or it fails. CUDA
  ordinals are TensorFlow's physical GPU order.
  """
  for name in ('libcuda.so.1', 'libcuda.so'):
    try:
      lib = ctypes.CDLL(name)
    except OSError:
      continue
    try:
      if lib.cuInit(0) != 0:
        return None
      totals = []
      for i in range(num_devices):
        device = ctypes.c_int()
        size = ctypes.c_size_t()
        if (lib.cuDeviceGet(ctypes.byref(device), i) != 0 or
            lib.cuDeviceTotalMem_v2(ctypes.byref(size), device) != 0):
          return None
        totals.append(size.value)
    except AttributeError:
      return None
    return min(totals) // 2**20 if totals else None
  return None


def MemoryFromDeviceName(device_name):
  """MiB from a size in a GPU's name ('NVIDIA A100-SXM4-40GB'), else None.

  The name's GB are decimal, so this is a little under the true size.
  """
  m = re.search(r'(\d+)\s*GB\b', device_name or '')
  return int(m.group(1)) * 10**9 // 2**20 if m else None


def GpuMemoryMb(physical_gpus):
  """(MiB of the smallest GPU, where it came from), or (None, '')."""
  total = CudaTotalMemoryMb(len(physical_gpus))
  if total is not None:
    return total, 'from the CUDA driver'
  config = _Config()
  sizes = []
  for gpu in physical_gpus:
    try:
      name = config.experimental.get_device_details(gpu).get('device_name')
    except (ValueError, RuntimeError):
      name = None
    size = MemoryFromDeviceName(name)
    if size is None:
      return None, ''
    sizes.append((size, name))
  if not sizes:
    return None, ''
  size, name = min(sizes)
  return size, f'from its name {name!r}'


def _Config():
  """tf.config: the one seam through which this module configures TensorFlow."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.config


def _LogicalDeviceConfiguration(memory_limit=None):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit)


def VisibleGpus():
  """The physical GPUs TensorFlow may use (after any set_visible_devices)."""
  return list(_Config().get_visible_devices('GPU'))


def ChooseDeviceType(run_locally='auto', flag='--run_locally'):
  """'GPU' or 'CPU' for run_locally in ('auto', 'gpu', 'cpu').

  'auto' is GPU when one is visible. 'cpu' hides the GPUs from TensorFlow,
  so nothing lands on them by default. Must run before TensorFlow starts
  if GPUs are to be hidden.

  Raises:
    ValueError: 'gpu' with no GPU visible (quoting TensorFlow's start-up
      errors, e.g. a failed cuInit), or an unknown value.
  """
  if run_locally not in ('auto', 'gpu', 'cpu'):
    raise ValueError(f'{flag}={run_locally!r}; expected auto, cpu or gpu.')
  gpus = VisibleGpus()
  if run_locally == 'cpu':
    if gpus:
      try:
        _Config().set_visible_devices([], 'GPU')
      except RuntimeError:
        raise ValueError(f'{flag}=cpu, but TensorFlow has already started on '
                         'the GPU; choose the device before TensorFlow runs '
                         'any op.') from None
    return 'CPU'
  if gpus:
    return 'GPU'
  if run_locally == 'gpu':
    from tfpipe import quiet  # pylint: disable=g-import-not-at-top
    said = '; '.join(line.split('] ', 1)[-1]
                     for line in quiet.StartupErrors())
    said = f' TensorFlow said: {said}.' if said else (
        ' Rerun with --verbosity=1 to see TensorFlow\'s start-up log.')
    raise ValueError(f'{flag}=gpu but no GPU is visible; use {flag}=cpu, or '
                     f'check the CUDA driver and CUDA_VISIBLE_DEVICES.{said}')
  return 'CPU'


def _ConfiguredCount(config, physical):
  """Logical devices the physical devices will have (or have) as configured."""
  total = 0
  for device in physical:
    logical = config.get_logical_device_configuration(device)
    total += len(logical) if logical else 1
  return total


def _Apply(split, physical):
  """Applies `split`; raises RuntimeError if TensorFlow has already started."""
  config = _Config()
  if split.device_type == 'CPU':
    config.set_logical_device_configuration(
        physical[0], [_LogicalDeviceConfiguration()] * split.counts[0])
    return
  used = physical[:len(split.counts)]
  config.set_visible_devices(used, 'GPU')
  if split.memory_limit_mb is not None:
    for device, count in zip(used, split.counts):
      config.set_logical_device_configuration(device, [
          _LogicalDeviceConfiguration(split.memory_limit_mb)] * count)


def _Physical(device_type):
  if device_type == 'GPU':
    return VisibleGpus()
  return list(_Config().list_physical_devices(device_type))


def _Plan(device_type, num_needed, memory_limit_mb, memory_name):
  physical = _Physical(device_type)
  memory, source = (None, '')
  if device_type == 'GPU' and physical and (
      memory_limit_mb is not None or num_needed > len(physical)):
    memory, source = GpuMemoryMb(physical[:num_needed])
  return physical, PlanSplit(device_type, len(physical), num_needed,
                             physical_memory_mb=memory,
                             memory_limit_mb=memory_limit_mb,
                             memory_source=source, memory_name=memory_name)


def LogicalDeviceNames(device_type):
  """Names of the logical devices of a type ('/device:GPU:0', ...).

  Starts TensorFlow's runtime if it has not started.
  """
  return [d.name for d in _Config().list_logical_devices(device_type)]


def SplitLocalDevices(device_type, num_needed, memory_limit_mb=None,
                      memory_name='memory_limit_mb'):
  """Splits the local devices of a type into `num_needed` logical devices.

  Call before TensorFlow starts its runtime. If it has started already
  (e.g. a second trainer run in one test process), the existing devices are
  kept when there are enough.

  Returns:
    (Split applied, or None if the existing devices were kept; the logical
    device names).

  Raises:
    ValueError: the split is impossible (PlanSplit's errors), or TensorFlow
      has started with too few devices.
  """
  device_type = str(device_type).upper()
  physical, split = _Plan(device_type, num_needed, memory_limit_mb,
                          memory_name)
  try:
    _Apply(split, physical)
  except RuntimeError:
    names = LogicalDeviceNames(device_type)
    if len(names) < num_needed:
      raise ValueError(_TooFewMessage(device_type, num_needed, names)) from None
    return None, names
  return split, LogicalDeviceNames(device_type)


def EnsureLogicalDevices(num_needed, device_type=None, memory_limit_mb=None,
                         log=None):
  """Names of `num_needed` local logical devices, splitting if it must.

  For code that places a pipeline by default. Devices already configured
  (or already created) are used when there are enough; otherwise the
  physical devices are split as PlanSplit says, which TensorFlow allows only
  before its runtime starts.

  Args:
    num_needed: devices wanted (e.g. partitions x replicas).
    device_type: 'GPU' or 'CPU'; None: GPU if one is visible, else CPU.
    memory_limit_mb: memory of each logical GPU if GPUs are split; None:
      shared evenly.
    log: called with one line describing a split, if one was made.

  Returns:
    The first `num_needed` logical device names of that type.

  Raises:
    ValueError: TensorFlow has started with fewer devices (saying how to get
      more), or the split is impossible.
  """
  if device_type is None:
    device_type = 'GPU' if VisibleGpus() else 'CPU'
  device_type = str(device_type).upper()
  if device_type not in DEVICE_TYPES:
    names = LogicalDeviceNames(device_type)
    if len(names) < num_needed:
      raise ValueError(_TooFewMessage(device_type, num_needed, names))
    return names[:num_needed]
  config = _Config()
  physical = _Physical(device_type)
  if physical and _ConfiguredCount(config, physical) >= num_needed:
    names = LogicalDeviceNames(device_type)
    if len(names) >= num_needed:
      return names[:num_needed]
  split, names = SplitLocalDevices(device_type, num_needed, memory_limit_mb)
  if split is not None and log is not None:
    log(split.Describe(f'{num_needed} devices needed'))
  return names[:num_needed]


def _TooFewMessage(device_type, num_needed, names):
  return (
      f'{num_needed} {device_type} devices are needed but TensorFlow has '
      f'already started with {len(names)} ({", ".join(names) or "none"}), '
      'and logical devices can only be made before it starts. Call '
      f'tfpipe.devices.EnsureLogicalDevices({num_needed}) before anything '
      "else runs TensorFlow ops (the trainer's --num_devices does this), or "
      'use fewer partitions x replicas.')
