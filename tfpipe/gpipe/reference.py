"""The un-pipelined reference of a pipeline: how to check a pipelined model.

A pipeline promises what a plain run of its layers would give: the same
loss and the same gradients (torchgpipe's "transparency"). To check that for
your own model, build the same layers as one `SequentialLayer` on one
device, with the pipeline's initial values, and compare:

    ref = gpipe.UnpipelinedReference(pipe)
    out = pipe.ComputeLossAndGradients(x, y, loss_fn)
    with tf.GradientTape() as tape:
      loss, _ = loss_fn(ref(x, training=True), y)
    ref_grads = tape.gradient(loss, ref.trainable_variables)
    # out.gradients[i] and ref_grads[i] are of the variable whose path is
    # pipe.trainable_variables[i].path == ref.trainable_variables[i].path.

The reference is a copy, not a view: it has its own variables, so training
it leaves the pipeline alone. Values are matched by variable path, which
names the layers but not the cells (`block_3/ffn_in/w`; see base_layer), so
the pipeline's cut does not matter.

Random layers draw their masks from the pipeline's step seed, which a plain
call does not set: compare with `training=False`, or with dropout off.
"""

import contextlib

import tensorflow as tf

from tfpipe import layers
from tfpipe.gpipe import partition


def UnpipelinedReference(pipe, input_shape=None, device=None, name=None):
  """The layers of `pipe` as one SequentialLayer, holding the pipe's values.

  Args:
    pipe: a PipeliningLayer (built if its cells build lazily).
    input_shape: the pipeline's input shape, to build layers that create
      their variables in `build` (wrapped Keras layers); None if every
      layer creates them when instantiated (tfpipe's own layers).
    device: where the reference lives and runs; None: the current device.
    name: the reference's name; default '<pipe name>_reference'.

  Returns:
    A layers.SequentialLayer whose variables, trainable and not, equal the
    pipeline's and are listed in the same order with the same paths.

  Raises:
    ValueError: naming a variable of either side that has no counterpart.
  """
  flat = partition.FlattenSequentialLayers(list(pipe.p.cell_tpl))
  params = layers.SequentialLayer.Params().Set(
      name=name or f'{pipe.name}_reference', sub=[p.Copy() for p in flat])
  with tf.device(device) if device else contextlib.nullcontext():
    reference = params.Instantiate()
    if input_shape is not None:
      reference.build(input_shape)
  CopyValues(_CellVariables(pipe), reference.variables, pipe.name)
  return reference


def _CellVariables(pipe):
  return [v for cell in pipe.cells for v in cell.variables]


def CopyValues(source, target, source_name='the pipeline'):
  """Assigns each `target` variable the value of the `source` one of its path.

  Raises:
    ValueError: if a path is missing on either side or repeats.
  """
  by_path = {}
  for v in source:
    if v.path in by_path:
      raise ValueError(
          f'{source_name}: variable path {v.path!r} repeats; give the layers '
          'unique names so that each variable has its own path.')
    by_path[v.path] = v
  missing = [v.path for v in target if v.path not in by_path]
  extra = sorted(set(by_path) - {v.path for v in target})
  if missing or extra:
    raise ValueError(
        f'{source_name}: the reference and the pipeline have different '
        f'variables (only in the reference: {missing}; only in the pipeline: '
        f'{extra}). If the pipeline\'s layers build lazily, pass input_shape '
        'and build the pipeline first.')
  for v in target:
    v.assign(by_path[v.path])
