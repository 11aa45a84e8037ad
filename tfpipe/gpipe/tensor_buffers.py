"""The allocator bytes that a set of eager tensors holds.

What a forward keeps for its backward is a set of tensors. Their bytes stay
the same from one step to the next, where the allocator's bytes in use
around the forward do not (action_memory.py). Tensors can share a buffer
(an Identity's output, a variable's read value), so each distinct buffer is
counted once, found by its address, and rounded up as the allocator
rounds.

TensorFlow is imported when first used, so that a process can import this
module before it sets the allocator's environment variables.
"""

import ctypes

import numpy as np

# BFC hands out memory in multiples of this many bytes (kMinAllocationSize).
ALLOCATION_GRAIN = 256

_CAPSULE_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
_CAPSULE_POINTER.restype = ctypes.c_void_p
_CAPSULE_POINTER.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _Tf():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf


def LeafBytes(t):
  """The bytes of one tensor's elements (a variable's or a shape's too)."""
  tf = _Tf()
  return int(np.prod(tuple(t.shape), dtype=np.int64)) * tf.as_dtype(
      t.dtype).size


def BufferAddress(t):
  """The address of an eager tensor's buffer, or None where it has none.

  DLPack shares the buffer without a copy, on a CPU and a GPU alike, so two
  tensors that alias give the same address.
  """
  tf = _Tf()
  try:
    capsule = tf.experimental.dlpack.to_dlpack(t)
  except Exception:  # pylint: disable=broad-except
    return None  # Empty, remote, or a dtype DLPack cannot carry.
  # A DLManagedTensor starts with its DLTensor, which starts with `data`.
  return ctypes.c_void_p.from_address(
      _CAPSULE_POINTER(capsule, b'dltensor')).value


def Addresses(tensors):
  """The buffer addresses of `tensors` that have one."""
  return {a for a in map(BufferAddress, tensors) if a is not None}


def HeldBytes(tensors, existing=(), among=None):
  """The allocator's bytes for the distinct buffers of `tensors` that are
  not among the addresses `existing` (buffers that were there before).

  A tensor whose buffer has no address (see BufferAddress) is counted.
  Other values in `tensors` (None, Python numbers) are skipped. With
  `among` (addresses), only buffers at those addresses count: what of an
  action's input its record holds, say.
  """
  tf = _Tf()
  seen = set(existing)
  total = 0
  for t in tensors:
    if not isinstance(t, tf.Tensor):
      continue
    size = LeafBytes(t)
    if not size:
      continue
    address = BufferAddress(t)
    if among is not None and address not in among:
      continue
    if address is not None:
      if address in seen:
        continue
      seen.add(address)
    total += -(-size // ALLOCATION_GRAIN) * ALLOCATION_GRAIN
  return total
