"""A hard memory limit for a CPU process: the CPU stand-in for an accelerator.

GPipe's promise is a model that does not fit one accelerator trained on
several, each with its own fixed memory. On CPU, TensorFlow's allocator
becomes the BFC allocator with TF_CPU_ALLOCATOR_USE_BFC=true, and
TF_CPU_BFC_MEM_LIMIT_IN_MB=N caps it: an allocation beyond N MiB fails with
`ResourceExhaustedError: OOM when allocating tensor`, as on a GPU. Both are
read once, when TensorFlow starts, so they belong in the environment of a
process before it imports TensorFlow.

One process per device, each capped, is then K accelerators of N MiB: the
launcher's --device_memory_mb puts the limit in each worker's environment
(and only there), the benchmarks and tests in their workers'. Logical CPU
devices in one process share one allocator, so a cap in such a process is
shared by all of them.

The BFC allocator also counts: `tf.config.experimental.get_memory_info`
reports the bytes in use and the peak, which the default CPU allocator does
not.

A GPU's allocator takes its whole memory as one region when the process
starts; the CPU's grows by regions of 2, 4, 8, ... MiB as allocations need
them. A tensor cannot span two regions, and a free chunk is split only when
it is at least twice the request, so on a capped CPU the last tensor of each
region took the region's whole tail: on a 21 MiB cap, 17 variables of 1 MiB
fit where 20 do on a GPU-like allocator, and the same pipeline peaked 1 to 4
MiB higher from one start to the next, as the variables happened to fall
(benchmarks/RESULTS.md, "One region per capped process"). OpenOneRegion makes
the first allocation of a capped process the whole limit, so its allocator
is one region, as a GPU's is.
"""

import os

BFC_ENV = 'TF_CPU_ALLOCATOR_USE_BFC'
LIMIT_ENV = 'TF_CPU_BFC_MEM_LIMIT_IN_MB'
MIB = 2**20
_opened_one_region = False  # OpenOneRegion's, once per process.


def CappedEnv(memory_mb, environ=None):
  """A copy of `environ` (default os.environ) for a process with a limit.

  Args:
    memory_mb: the hard limit in MiB; None: the BFC allocator (which counts
      bytes) with no limit of its own.
    environ: the environment to start from.

  Raises:
    ValueError: memory_mb is not a positive integer.
  """
  env = dict(os.environ if environ is None else environ)
  env[BFC_ENV] = 'true'
  env.pop(LIMIT_ENV, None)
  if memory_mb is not None:
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or (
        memory_mb < 1):
      raise ValueError('A device memory limit is a whole number of MiB >= 1. '
                       f'Received: device_memory_mb={memory_mb!r}')
    env[LIMIT_ENV] = str(memory_mb)
  return env


def UsesBfc(environ=None):
  """True when this process's CPU allocator is BFC (read at TF's start)."""
  env = os.environ if environ is None else environ
  return env.get(BFC_ENV, '').strip().lower() in ('1', 'true')


def LimitMb(environ=None):
  """This process's hard CPU memory limit in MiB, or None if it has none."""
  env = os.environ if environ is None else environ
  if not UsesBfc(env):
    return None
  text = env.get(LIMIT_ENV, '').strip()
  try:
    value = int(text)
  except ValueError:
    return None
  return value if value > 0 else None


def OpenOneRegion():
  """Makes a capped process's CPU allocator one region of its whole limit.

  Call it before the process's first tensor: the allocator's first region
  is sized by the first allocation, and this one asks for the whole limit
  (a copy of a NumPy array, the only tensor whose creation allocates
  nothing before it), then frees it. Its pages stay the process's, as a
  GPU's memory is its process's from the start.

  Returns:
    True if the allocator is now one region of the limit; False if the
    process has no limit, a limit above half the host's memory (a cap that
    only counts), or allocated before (its regions are then as they grew).
  """
  global _opened_one_region
  limit = LimitMb()
  if (_opened_one_region or limit is None or
      limit * MIB > _HostBytes() / 2):
    return False
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if tf.config.experimental.get_memory_info('CPU:0')['peak'] > 0:
    return False
  with tf.device('/CPU:0'):
    region = tf.constant(np.zeros(limit * MIB, np.uint8))
  opened = tf.config.experimental.get_memory_info('CPU:0')['peak'] >= (
      limit * MIB)
  del region
  # The peak is the process's tensors', not this reservation's.
  tf.config.experimental.reset_memory_stats('CPU:0')
  _opened_one_region = opened
  return opened


def _HostBytes():
  try:
    return os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
  except (ValueError, OSError, AttributeError):
    return float('inf')
