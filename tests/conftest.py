"""Test setup: quiet TensorFlow logs and split the CPU into 8 logical devices.

Logical devices must be configured before TensorFlow initialises its runtime,
so this runs at import, before any test module touches a tensor.
"""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import pytest  # pylint: disable=g-import-not-at-top
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


@pytest.fixture(autouse=True)
def _restore_op_determinism():
  """A test that runs the trainer's main in this process turns on op
  determinism (--deterministic), process-wide, as a real run should; the
  next test in the process must not inherit it (tf.timestamp() refuses to
  run under it). Which tests share a process depends on pytest-xdist."""
  from tensorflow.python.framework import config as tf_config  # pylint: disable=g-import-not-at-top
  before = tf_config.is_op_determinism_enabled()
  yield
  if tf_config.is_op_determinism_enabled() != before:
    if before:
      tf_config.enable_op_determinism()
    else:
      tf_config.disable_op_determinism()
