"""What a fresh device holds after its build, beyond its tensors.

Every memory profile (gpipe/memory_profile.py) counts bytes in an
allocator that has run other cells; a device starts empty. A fresh
one-region allocator (a GPU's, a capped worker's:
tfpipe.memory_limit.OpenOneRegion) can hold more than the variables and
slots it was given: an initializer's temporaries leave a hole in front of
the variable, the next small tensor takes its first bytes, and a slot of
the variable's size then gets the rest of the hole whole (BFC splits a
free chunk only if it is at least twice the request). On an MLP's
1024x1024 layer with Adam that is 16 MiB held for 12, on a fresh logical
GPU of an H200 and on a fresh capped CPU process alike. So each distinct
cell's variables and slots are also built once on a fresh one-region
allocator (`BuildSlack`, in a subprocess that memory_profile starts:
python -m tfpipe.gpipe.allocator_slack), and what it holds beyond their
bytes is the cell's `memory_model.CellMemory.allocator_slack_bytes`.
"""

import gc
import pickle
import sys

from tfpipe.gpipe import memory_profile


def BuildSlack(request):
  """Each of the request's cells' allocator slack, in bytes, or None.

  Builds each cell as a one-cell pipeline, then the task's optimizer's slots
  for its variables, as a device's build does, and reads what the allocator
  holds beyond their bytes. Must run in a fresh process capped by
  tfpipe.memory_limit.CappedEnv. For a GPU (request.device), each cell gets
  its own logical GPU of the cap, a fresh one-region allocator as a real
  device's is. On the CPU, whose one allocator is made one region of the
  cap (memory_limit.OpenOneRegion; None if it could not be), only the first
  cell is measured on a fresh allocator: give one cell per process.
  """
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if request.device is not None and 'GPU' in request.device.upper():
    gpus = tf.config.list_physical_devices('GPU')
    if not gpus:
      return None
    tf.config.set_logical_device_configuration(gpus[0], [
        tf.config.LogicalDeviceConfiguration(
            memory_limit=memory_limit.LimitMb())] * len(request.cells))
    devices = [f'/GPU:{i}' for i in range(len(request.cells))]
  elif not memory_limit.OpenOneRegion():
    return None
  else:
    devices = [None] * len(request.cells)
  from tfpipe.gpipe import pipelining_layer  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  slacks = []
  for cell, shape, device in zip(request.cells, request.input_shapes,
                                 devices):
    allocator = memory_profile.AllocatorName(device)
    before = tf.config.experimental.get_memory_info(allocator)['current']
    pipe = pipelining_layer.PipeliningLayer.Params().Set(
        name='build', cell_tpl=[cell.Copy()], num_micro_batches=1,
        devices=[device or memory_profile.LocalCpu()], executor='threads',
        schedule='gpipe').Instantiate()
    pipe.build(shape)
    optimizer = optimizer_lib.BuildOptimizer(request.optimizer_params, 1e-3)
    with tf.device(device or memory_profile.LocalCpu()):
      optimizer.build(pipe.trainable_variables)
    held = tf.config.experimental.get_memory_info(allocator)['current'] - (
        before)
    tensors = memory_profile.Bytes(pipe.variables) + sum(
        memory_profile.LeafBytes(v) for v in optimizer.variables
        if v.value.device.upper().endswith(allocator))
    slacks.append(max(0, held - tensors))
    del pipe, optimizer
    gc.collect()
  return slacks


def _Main(argv):
  from tfpipe import quiet  # pylint: disable=g-import-not-at-top
  quiet.ImportTensorFlow()
  request_path, output_path = argv[1:3]
  with open(request_path, 'rb') as f:
    request = pickle.load(f)
  result = BuildSlack(request)
  with open(output_path, 'wb') as f:
    pickle.dump(result, f)


if __name__ == '__main__':
  _Main(sys.argv)
