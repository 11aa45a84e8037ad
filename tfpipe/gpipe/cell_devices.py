"""Which device each cell goes on: the user's list, checked, or a default.

Device names are checked against TensorFlow's logical devices before any
cell is built, so a typo or a missing split fails with the fix named
instead of placing variables on the wrong device.
"""

import tensorflow as tf

from tfpipe import device_names
from tfpipe import devices as devices_lib


def DefaultDevices(num_needed=None):
  """Where a pipeline goes when `devices` is None.

  Args:
    num_needed: how many devices (cells x replicas). With fewer GPUs than
      that, the GPUs are split into logical GPUs, as the trainer does, if
      TensorFlow has not started yet (tfpipe.devices.EnsureLogicalDevices);
      otherwise a ValueError says how to get them. None: every device of
      the first kind there is.

  Returns:
    Device names: GPUs, else TPU cores, else (logical) CPU devices.
  """
  # Physical devices can be listed without starting TensorFlow's runtime;
  # listing logical ones starts it, after which no device can be split.
  if num_needed is not None and not tf.config.list_physical_devices('TPU'):
    return devices_lib.EnsureLogicalDevices(num_needed)
  for kind in ('GPU', 'TPU', 'CPU'):
    devices = tf.config.list_logical_devices(kind)
    if devices:
      return [d.name for d in devices]
  return ['/CPU:0']


def ResolveDevices(devices, num_cells, round_robin_placement=False):
  """Checks device names and returns one device per cell.

  Raises:
    ValueError: naming an unknown device, or saying how to place more cells
      than there are devices.
  """
  if devices is None:
    devices = DefaultDevices(None if round_robin_placement else num_cells)
  if not devices:
    raise ValueError('devices is empty; list one device per cell or pass None.')
  known = {device_names.CanonicalDevice(d.name): d.name
           for d in tf.config.list_logical_devices()}
  for d in devices:
    try:
      canonical = device_names.CanonicalDevice(d)
    except ValueError as e:
      raise ValueError(f'devices: cannot parse device name {d!r}: {e}') from e
    if canonical not in known:
      raise ValueError(
          f'devices: unknown device {d!r}. Available devices: '
          f'{sorted(known.values())}. On CPU, split the CPU into logical '
          'devices with tf.config.set_logical_device_configuration (or the '
          "trainer's --num_devices); for remote devices connect to the "
          'cluster first.')
  if len(devices) < num_cells and not round_robin_placement:
    raise ValueError(
        f'{num_cells} cells need {num_cells} devices but devices lists '
        f'{len(devices)}: {devices}. Use fewer partitions, list more devices, '
        'or set round_robin_placement=True to place cell k on '
        'devices[k % len(devices)].')
  return [devices[k % len(devices)] for k in range(num_cells)]
