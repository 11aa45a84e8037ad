"""Device names: one canonical form, and the layout of a pipeline's devices.

TensorFlow spells one device several ways: '/CPU:0', '/device:CPU:0' and
'/job:localhost/replica:0/task:0/device:CPU:0' are the same device, and a
variable reports the long form of the device a user gave in the short one.
`CanonicalDevice` is the one place tfpipe turns a name into the form it
compares (the pipeline's device check, the placement audit, the
benchmarks' placement checks); a process's own devices are job 'localhost',
replica 0, task 0, as TensorFlow names them. `AllocatorName` is the short
form TensorFlow's memory queries take.

A pipeline of R replicas x K cells takes a replica-major device list
(slot r*K + k); `WorkerDevices` lays such a list out over the workers of
a cluster, and `DeviceMeshText` prints any such list as a table.

TensorFlow is imported only inside the function that needs it.
"""

from tfpipe import cluster_spec


def CanonicalDevice(name):
  """The full name of a device, with the job, replica and task filled in.

  Raises:
    ValueError: `name` is not a device name.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = tf.DeviceSpec.from_string(name)
  return spec.replace(
      job='localhost' if spec.job is None else spec.job,
      replica=0 if spec.replica is None else spec.replica,
      task=0 if spec.task is None else spec.task).to_string()


def AllocatorName(device):
  """The name tf.config.experimental.get_memory_info takes for a device of
  this process: its type and index ('GPU:1')."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = tf.DeviceSpec.from_string(device)
  return f'{(spec.device_type or "CPU").upper()}:{spec.device_index or 0}'


def SameDevice(a, b):
  """True when the names `a` and `b` stand for one device."""
  return CanonicalDevice(a) == CanonicalDevice(b)


def OnOtherProcess(device):
  """Whether `device` belongs to another process's server (a worker task).

  A device of this process (job 'localhost', or this process's own job and
  task once it joined a cluster) runs what this process holds, Python
  functions included; another process's device, whatever its type, runs
  only what TensorFlow sends it.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  spec = tf.DeviceSpec.from_string(device)
  if spec.job in (None, 'localhost'):
    return False
  local = tf.DeviceSpec.from_string(context.context().host_address_space())
  return (spec.job, spec.task or 0) != (local.job, local.task or 0)


def WorkerDevices(num_cells, num_workers, num_replicas=1,
                  device_type='CPU', job=cluster_spec.WORKER_JOB,
                  devices_per_worker=1):
  """R*K device names, replica-major, spread over W workers.

  Slot i = r*K + k (replica r, cell k) goes to worker i % W, device
  (i // W) % devices_per_worker: with W >= R*K every cell has its own worker;
  with fewer workers they are shared round-robin.
  """
  for name, value in (('num_cells', num_cells), ('num_workers', num_workers),
                      ('num_replicas', num_replicas),
                      ('devices_per_worker', devices_per_worker)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f'{name} must be an int >= 1; received {value!r}.')
  return [f'/job:{job}/replica:0/task:{i % num_workers}/device:{device_type}:'
          f'{(i // num_workers) % devices_per_worker}'
          for i in range(num_cells * num_replicas)]


def DeviceMeshText(devices, num_replicas):
  """The (replicas, cells) mesh of a replica-major device list, as a table."""
  if num_replicas < 1 or not devices or len(devices) % num_replicas:
    raise ValueError(f'{len(devices)} devices do not make {num_replicas} '
                     'equal replicas; give num_replicas x cells devices.')
  k = len(devices) // num_replicas
  rows = [f'device mesh: {num_replicas} replica(s) x {k} cell(s)']
  for r in range(num_replicas):
    rows.append(f'  replica {r}: ' + '  '.join(
        f'[{s}] {d}' for s, d in enumerate(devices[r * k:(r + 1) * k])))
  return '\n'.join(rows)
