"""Test setup: quiet TensorFlow logs and split the CPU into 8 logical devices.

Logical devices must be configured before TensorFlow initialises its runtime,
so this runs at import, before any test module touches a tensor.
"""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

NUM_LOGICAL_CPUS = 8


def _SplitCpu():
  cpus = tf.config.list_physical_devices('CPU')
  try:
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)
  except RuntimeError:
    pass  # Already initialised (e.g. by a test run in the same process).


_SplitCpu()
