"""Statistics that layers apply once per step, not once per micro-batch.

A pipeline runs each layer once per micro-batch. A batch-norm layer in
training must still update its moving averages once, from the whole batch's
statistics (torchgpipe's deferred batch norm): it records each micro-batch's
here, and the step applies them all at its end. The step installs the
collector with `base_layer.CollectDeferredStats`; layers find it with
`base_layer.CurrentStatsCollector`.

A layer whose statistics are a batch's moments (batch norm) says so with
`ApplyMergedMoments(mean, variance)`. Inside a pipeline cell, all such
layers' records of one micro-batch travel as three vectors (`PackMoments`),
which the step's update unpacks (`MomentsGroup`): AmoebaNet-D holds
hundreds of batch norms, whose per-layer records were three tensors each
per micro-batch, every one an output of the cell's function, an input of
the step's update and, eagerly, a tensor the update's call converted on
every step.
"""

import contextlib
import threading
import weakref

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


def MergeMoments(records):
  """The full batch's (mean, variance) from its parts' records.

  Args:
    records: list of (count, {'mean': m, 'variance': v}), count the number
      of elements each part reduced per channel.

  Stacked, the merge is 15 ops whatever the number of parts (as a sum of
  products, 40 at 8 parts): a deep network merges hundreds of layers per
  step, and each op is traced (or, eagerly, a round trip to a remote
  worker).
  """
  counts = tf.stack([tf.cast(c, tf.float32) for c, _ in records])
  means = tf.stack([tf.cast(s['mean'], tf.float32) for _, s in records])
  variances = tf.stack(
      [tf.cast(s['variance'], tf.float32) for _, s in records])
  weights = tf.reshape(counts / tf.reduce_sum(counts),
                       [-1] + [1] * (means.shape.rank - 1))
  mean = tf.reduce_sum(weights * means, axis=0)
  # E[x^2] of each part is v + m^2; the merged variance is E[x^2] - mean^2.
  second_moment = tf.reduce_sum(
      weights * (variances + tf.square(means)), axis=0)
  return mean, tf.maximum(second_moment - tf.square(mean), 0.0)


class MomentsGroup:
  """The layers whose moments one cell packs into one record (PackMoments).

  The collector keys records by the object they name, so every micro-batch
  (and replica) of a cell must name the same group: groups are shared by
  their members and sizes (`Of`), whichever program traced them.
  """

  _groups = weakref.WeakValueDictionary()
  _lock = threading.Lock()  # Cells may be traced from several threads.

  def __init__(self, members, sizes):
    self.members = list(members)  # Held: their ids key the group.
    self.sizes = list(sizes)

  @classmethod
  def Of(cls, members, sizes):
    key = tuple((id(m), n) for m, n in zip(members, sizes))
    with cls._lock:
      group = cls._groups.get(key)
      if group is None:
        group = cls._groups[key] = cls(members, sizes)
      return group

  def ApplyDeferredStats(self, records):
    """Unpacks the records and merges each member's as it would alone.

    Merged at once, the packed vectors' stacked temporaries (several times
    M x all the cell's channels) were alive together at the step's end,
    the update's peak: AmoebaNet-D's pipeline-8 at L=102 no longer fitted
    its 32 MiB. One member at a time, the merge holds M x its channels.
    """
    parts = [(tf.unstack(counts), tf.split(stats['mean'], self.sizes),
              tf.split(stats['variance'], self.sizes))
             for counts, stats in records]
    updates = []
    for i, member in enumerate(self.members):
      update = member.ApplyMergedMoments(*MergeMoments(
          [(counts[i], {'mean': means[i], 'variance': variances[i]})
           for counts, means, variances in parts]))
      if update is not None:
        updates.append(update)
    return tf.group(*updates) if updates and not tf.executing_eagerly() else (
        None)


def _Packable(layer, count, stats):
  """Whether a record is a batch's moments that a MomentsGroup can merge:
  its layer applies merged moments, its count is one number, and its mean
  and variance are vectors of a known length."""
  if not callable(getattr(layer, 'ApplyMergedMoments', None)):
    return False
  if not isinstance(stats, dict) or set(stats) != {'mean', 'variance'}:
    return False
  shapes = [tf.TensorShape(getattr(stats[k], 'shape', None))
            for k in ('mean', 'variance')]
  return (tf.TensorShape(getattr(count, 'shape', [])).rank == 0 and
          all(s.rank == 1 and s.is_fully_defined() for s in shapes) and
          shapes[0] == shapes[1])


def PackMoments(entries):
  """A cell's records [(layer, count, stats)] with the moments of every
  layer that merges them (_Packable) as one record of a MomentsGroup, in
  the place of the first: (group, the layers' counts, {'mean', 'variance'}
  as float32 vectors, the layers' one after another). The group merges
  exactly what each layer's own merge would. Fewer than two such records
  are left as they are."""
  packable = [i for i, (layer, count, stats) in enumerate(entries)
              if _Packable(layer, count, stats)]
  if len(packable) < 2:
    return list(entries)
  members = [entries[i] for i in packable]
  sizes = [int(stats['mean'].shape[0]) for _, _, stats in members]
  group = MomentsGroup.Of([layer for layer, _, _ in members], sizes)
  counts = tf.stack([tf.cast(count, tf.float32) for _, count, _ in members])
  packed = {k: tf.concat([tf.cast(stats[k], tf.float32)
                          for _, _, stats in members], 0)
            for k in ('mean', 'variance')}
  chosen = set(packable)
  result = []
  for i, entry in enumerate(entries):
    if i == packable[0]:
      result.append((group, counts, packed))
    elif i not in chosen:
      result.append(entry)
  return result


def _OnDevice(device):
  """tf.device(device), or no placement when the record named none."""
  return tf.device(device) if device else contextlib.nullcontext()


# Traced updates kept per caller: one per device and step structure (the
# layers that recorded and how many records each); a caller's steps share
# one, so a few cover any change of the number of micro-batches.
_MAX_TRACED_UPDATES = 64
