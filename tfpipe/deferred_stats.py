"""Statistics that layers apply once per step, not once per micro-batch.

A pipeline runs each layer once per micro-batch. A batch-norm layer in
training must still update its moving averages once, from the whole batch's
statistics (torchgpipe's deferred batch norm): it records each micro-batch's
here, and the step applies them all at its end. The step installs the
collector with `base_layer.CollectDeferredStats`; layers find it with
`base_layer.CurrentStatsCollector`.
"""

import contextlib

import tensorflow as tf


class DeferredStatsCollector:
  """Gathers statistics that layers want applied once per step, not per micro-batch.

  The pipeline runs a layer once per micro-batch. A batch-norm layer in
  training records each micro-batch's (mean, variance) here with the number of
  examples they cover, instead of updating its moving averages. After the last
  micro-batch the executor calls `Apply()`, which hands each layer all its
  records; the layer merges them into full-batch statistics and updates once.
  A layer that records must implement `ApplyDeferredStats(records)`, where
  records is a list of (count, stats) with count a scalar float tensor.

  Applied eagerly, every layer's merge is a few dozen small ops, each a
  round trip when its device is a remote worker's: thousands per step for a
  deep network with batch norm. Given `traced_updates` (a dict the caller
  keeps across steps), the merges of one device are one traced call instead.
  """

  def __init__(self, traced_updates=None):
    """Starts an empty collection.

    Args:
      traced_updates: None, or a dict that outlives the collector, where an
        eager `Apply` keeps one tf.function per device and set of layers.
    """
    self._records = {}
    self._layers = {}
    self._devices = {}
    self._traced_updates = traced_updates

  @tf.autograph.experimental.do_not_convert
  def Add(self, layer, stats, count, device=None):
    """Records one micro-batch's statistics; `device` is where they were made.

    The merge and the update run on the device of the layer's first record
    (its cell's device), next to the layer's variables, rather than
    wherever the caller happens to be.
    """
    key = id(layer)
    self._layers[key] = layer
    self._devices.setdefault(key, device)
    self._records.setdefault(key, []).append((count, stats))

  def __len__(self):
    return len(self._records)

  @tf.autograph.experimental.do_not_convert
  def Apply(self):
    """Applies every layer's merged statistics; returns the update ops (graph mode)."""
    if self._traced_updates is not None and tf.executing_eagerly():
      self._ApplyTraced()
      return []
    updates = []
    for key, records in self._records.items():
      device = self._devices.get(key)
      with _OnDevice(device):
        update = self._layers[key].ApplyDeferredStats(records)
      if update is not None:
        updates.append(update)
    self._records.clear()
    self._devices.clear()
    return updates

  def _ApplyTraced(self):
    """Each device's merges as one call of a tf.function traced once."""
    by_device = {}
    for key in self._records:
      by_device.setdefault(self._devices.get(key), []).append(key)
    for device, keys in by_device.items():
      signature = (device, tuple((key, len(self._records[key]))
                                 for key in keys))
      update = self._traced_updates.get(signature)
      if update is None:
        layers = [self._layers[key] for key in keys]

        def Update(records, layers=layers, device=device):
          with _OnDevice(device):
            for layer, layer_records in zip(layers, records):
              layer.ApplyDeferredStats(layer_records)
        if len(self._traced_updates) >= _MAX_TRACED_UPDATES:
          self._traced_updates.clear()  # A new step structure: start over.
        update = self._traced_updates[signature] = tf.function(
            Update, autograph=False)
      with _OnDevice(device):
        update([self._records[key] for key in keys])
    self._records.clear()
    self._devices.clear()


def _OnDevice(device):
  """tf.device(device), or no placement when the record named none."""
  return tf.device(device) if device else contextlib.nullcontext()


# Traced updates kept per caller: one per device and step structure (the
# layers that recorded and how many records each); a caller's steps share
# one, so a few cover any change of the number of micro-batches.
_MAX_TRACED_UPDATES = 64
