"""`pipe(x)` under a GradientTape: the forward now, the pipeline's backward later.

Lingvo's idiom, and Keras' `fit` with a model that holds a PipeliningLayer,
take the gradient of `pipe(x)` with a GradientTape. TensorFlow would
differentiate the forward actions one by one, keeping every activation of
every micro-batch for the tape and summing one weight gradient per
micro-batch at the end: no re-materialization, and memory growing with M.
Instead the pipeline's output is one operation, made with
`tf.custom_gradient`, whose gradient runs the schedule's backward actions
(runtime.TapeBackward): re-materialized per the remat policy, with the
weight gradients added into the same per-variable buffers as a training
step.

`tf.custom_gradient` survives a function boundary: inside a tf.function
differentiated by a tape outside it, the function's gradient still calls
this backward, so re-materialization and bounded memory hold there too.
The forward records are kept until the tape is gone, so a persistent tape
can take a second gradient. The forward actions run with recording stopped:
a tape on the caller's thread would otherwise keep every activation of them.
"""

import tensorflow as tf
from tensorflow.python.eager import record  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import resource_variable_ops  # pylint: disable=g-direct-tensorflow-import

from tfpipe import placement
from tfpipe.gpipe import cell_program
from tfpipe.gpipe import microbatch


def WillDifferentiate(inputs, variables, training):
  """Whether a backward may follow `pipe(inputs)`, so F keeps what it needs.

  Eagerly, a tape on this thread says so. While tracing, a tape may be
  outside the function; a training forward is assumed to be differentiated
  then (keeping only inputs under re-materialization costs nothing if not).
  """
  if not variables and not cell_program.SplitFloat(inputs)[0]:
    return False
  if tf.executing_eagerly():
    return record.could_possibly_record()
  return record.could_possibly_record() or training


def NeedsInputGradient(float_inputs):
  """Whether the tape wants d loss / d the pipeline's input.

  Eagerly a tape knows whether it watches the inputs. In a graph a tape
  outside the function cannot be asked, so a float input gets a gradient
  unless it is a constant.
  """
  if not float_inputs:
    return False
  if tf.executing_eagerly():
    return record.should_record_backprop(float_inputs)
  return record.should_record_backprop(float_inputs) or any(
      tf.is_symbolic_tensor(t) and t.op.type != 'Const' for t in float_inputs)


def _RefuseVectorizing():
  """tape.jacobian vectorizes the gradient with pfor by default, which
  cannot batch the backward's accumulation into per-variable buffers."""
  if not tf.executing_eagerly() and 'loop_body' in (
      tf.compat.v1.get_default_graph().get_name_scope().split('/')):
    raise ValueError(
        'tfpipe: the gradient of a PipeliningLayer cannot be vectorized '
        '(tape.jacobian or batch_jacobian with experimental_use_pfor=True); '
        'pass experimental_use_pfor=False, which computes it row by row.')


def Forward(runtime, inputs, shards, training, collector, dispatchers,
            devices, batch_dim, tied=None):
  """The pipeline's output, recorded as one operation for the caller's tapes.

  Args:
    runtime: the PipelineRuntime.
    inputs: the pipeline's input.
    shards: runtime.MicroBatches per replica, split from `inputs`.
    training: the layers' mode.
    collector: DeferredStatsCollector of the forward, or None.
    dispatchers: fn() -> the dispatcher to issue actions with.
    devices: the first and the last cell's devices.
    batch_dim: the axis that holds the batch.
    tied: the pipeline's tied_variables.TiedVariables, or None. The engine
      differentiates the cells' copies of tied variables; the tape is given
      each tied variable's gradient, its copies' gradients folded in.

  Returns:
    The merged output, whose gradient runs the pipeline's backward.
  """
  float_inputs = cell_program.SplitFloat(inputs)[0]
  need_input_gradient = NeedsInputGradient(float_inputs)
  first_device, last_device = devices
  sizes = [list(shard.sizes) for shard in shards]
  flat_sizes = [n for per_replica in sizes for n in per_replica]

  @tf.custom_gradient
  def Pipelined(*float_args):
    del float_args  # The shards hold them, split into micro-batches.
    with record.stop_recording():
      micro_outputs, step = runtime.TapeForward(
          shards, training, collector, dispatchers(), need_input_gradient)
      with tf.device(last_device):
        merged = microbatch.Merge(
            [y for per_replica in micro_outputs for y in per_replica],
            batch_dim)
        float_outputs, rebuild = cell_program.SplitFloat(merged)
        float_outputs = [tf.identity(t) for t in float_outputs]
    rebuilt['fn'] = rebuild
    # The variables the backward returns gradients for: the trainable ones
    # now. Marked as read here, where tapes (and tf.custom_gradient) see it.
    taken = [v for k in range(runtime.num_cells)
             for v in step.variables[(0, k)]]
    if tied is not None and tied.ties:
      reported = [placement.TfVariable(v) for v in tied.CellVariables()]
    else:
      reported = taken
    for v in reported:
      resource_variable_ops.variable_accessed(v)

    def Backward(*output_gradients, variables=None):
      _RefuseVectorizing()
      with record.stop_recording():
        with tf.device(last_device):
          output_gradients = [
              tf.zeros_like(y) if g is None else g
              for g, y in zip(output_gradients, float_outputs)]
          pieces = [microbatch.SplitBySizes(g, flat_sizes, batch_dim)
                    for g in output_gradients]
        per_micro, i = [], 0
        for per_replica in sizes:
          per_micro.append([[p[i + m] for p in pieces]
                            for m in range(len(per_replica))])
          i += len(per_replica)
        input_gradients, gradients = runtime.TapeBackward(
            step, per_micro, dispatchers())
        if input_gradients is None:
          dx = [None] * len(float_inputs)
        else:
          with tf.device(first_device):
            flat = [g for per_replica in input_gradients for g in per_replica]
            dx = [tf.concat([g[j] for g in flat], axis=batch_dim)
                  if len(flat) > 1 else flat[0][j]
                  for j in range(len(float_inputs))]
      if not variables:
        return dx
      if reported is not taken:
        gradients = tied.Fold(gradients)
      # tf.custom_gradient asks for the variables it saw read, in its order.
      by_variable = {id(v): g for v, g in zip(reported, gradients)}
      return dx, [by_variable.get(id(placement.TfVariable(v)))
                  for v in variables or []]
    return float_outputs, Backward

  rebuilt = {}
  float_outputs = Pipelined(*float_inputs)
  return rebuilt['fn'](list(float_outputs))
