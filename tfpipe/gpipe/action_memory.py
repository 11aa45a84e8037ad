"""What one action of a profiled step holds in memory, as it runs.

A memory profile (memory_profile.py) issues a step's actions one at a time
and reads TensorFlow's allocator around each: the bytes in use before it,
the peak while it runs, the bytes in use after it. For a forward it also
counts the buffers it leaves for its backward (tensor_buffers.HeldBytes).
The allocator's bytes after a forward less those before move between steps
of one profile: tensors that other code makes or drops while it runs count
too (AmoebaNet-D's second cell of four at micro-batch 4: 2.3 to 2.9 MiB for
2.27 MiB of buffers). The buffers do not move, and bound what the forward
keeps from below (memory_profile._Worst). Whether the record holds the
forward's input is counted apart: a received input that it does not hold is
freed when the forward ends (AmoebaNet-D's cells without re-materialization:
their backward reads the ReLU's output, not the input).
"""

import dataclasses
import time
from typing import Optional

from tfpipe.gpipe import tensor_buffers


def _Tf():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf


@dataclasses.dataclass
class ActionRecord:
  """One action's bytes before, peak while running, bytes after; seconds.

  `held` is, for a forward, the bytes of the buffers its record for the
  backward (and its batch statistics) holds that did not exist before it;
  `held_input`, those of its input's buffers that the record holds. None
  for other actions.
  """
  action: object
  before: int
  peak: int
  after: int
  seconds: float
  held: Optional[int] = None
  held_input: Optional[int] = None

  @property
  def transient(self):
    return self.peak - self.before

  @property
  def delta(self):
    return self.after - self.before


def _ForwardHeld(step, item, existing, inputs):
  """(HeldBytes of what forward `item` left for its backward (its record and
  its batch statistics), the bytes of those at the `inputs` addresses), or
  (None, None) for a forward fused with its backward, which keeps nothing of
  this kind."""
  tf = _Tf()
  r, (_, m, k) = item
  record = step.kept.get((r, m, k))
  if not hasattr(record, 'tensors'):
    return None, None
  held = list(record.tensors) + tf.nest.flatten(step.stats.get((r, m, k), []))
  return (tensor_buffers.HeldBytes(held, existing),
          tensor_buffers.HeldBytes(held, among=inputs))


class MemoryRecordingDispatcher:
  """Issues a step's actions one at a time and records each one's memory.

  It speaks the dispatcher protocol of gpipe.dispatch (Run, last_tokens);
  a pipeline uses it through `SetThreadsDispatcher` with
  executor='threads', called eagerly, where every action is a separate
  function call that has finished when it returns.
  """

  name = 'memory_recording'

  def __init__(self, allocator='CPU:0'):
    from tfpipe.gpipe import dispatch  # pylint: disable=g-import-not-at-top
    self._inline = dispatch.Inline()
    self.allocator = allocator
    self.last_tokens = []
    self.records = []

  def Run(self, program, step, record_times=False):
    tf = _Tf()
    from tfpipe.gpipe import dispatch  # pylint: disable=g-import-not-at-top
    records = self.records
    allocator = self.allocator
    # A GPU runs an action's kernels after the call returns: its time ends
    # when its outputs exist. (Its memory is counted as the host allocates,
    # in issue order, either way.)
    wait = allocator.startswith('GPU')

    class _Measured:
      """The step, each Execute read around."""

      def Gather(self, item, store):
        return step.Gather(item, store)

      def Execute(self, item, args, store):
        forward = item[1].kind == 'F'
        if forward:  # What exists before F: its input and its variables.
          r, (_, _, k) = item
          inputs = tensor_buffers.Addresses(tf.nest.flatten(args))
          existing = inputs | tensor_buffers.Addresses([
              tf.convert_to_tensor(v) for v in step.variables[(r, k)] or []])
        tf.config.experimental.reset_memory_stats(allocator)
        before = tf.config.experimental.get_memory_info(allocator)['current']
        start = time.perf_counter()
        done = step.Execute(item, args, store)
        if wait:
          dispatch._WaitFor(done)  # pylint: disable=protected-access
        seconds = time.perf_counter() - start
        info = tf.config.experimental.get_memory_info(allocator)
        held = (_ForwardHeld(step, item, existing, inputs) if forward else
                (None, None))
        records.append(ActionRecord(
            item[1], before, info['peak'], info['current'], seconds, *held))
        return done

    times = self._inline.Run(program, _Measured(), record_times)
    self.last_tokens = self._inline.last_tokens
    return times
