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


# The files that take longest on CI's two cores (half a minute or more),
# longest first. pytest-xdist hands each worker whole files
# (--dist loadfile) in collection order, which is alphabetical: with
# tests/trainer/ near the end, one worker ran its largest files for minutes
# while the other had finished (30 minutes of CI on a 2-core AMD EPYC, 23
# on another run). Started first, they overlap the many short files.
_LONGEST_FIRST = (
    'tests/launcher_test.py',
    'tests/trainer/auto_plan_test.py',
    'tests/gpipe/pipelining_layer_test.py',
    'tests/keras/model_test.py',
    'tests/gpipe/runtime_test.py',
    'tests/benchmarks/device_memory_test.py',
    'tests/benchmarks/memory_test.py',
    'tests/benchmarks/largest_model_test.py',
    'tests/trainer/out_of_memory_test.py',
    'tests/benchmarks/memory_model_accuracy_test.py',
    'tests/gpipe/remote_runtime_test.py',
    'tests/trainer/data_safety_test.py',
    'tests/trainer/trainer_test.py',
    'tests/benchmarks/gradient_handover_test.py',
)


def pytest_collection_modifyitems(config, items):
  """Runs _LONGEST_FIRST's files first, in its order; the rest after, as
  collected (the sort is stable)."""
  rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
  root = str(config.rootpath)
  items.sort(key=lambda item: rank.get(
      os.path.relpath(str(item.path), root).replace(os.sep, '/'), len(rank)))
