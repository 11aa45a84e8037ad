"""Tests of input generators: shapes, determinism, resumption, file readers."""

import numpy as np
import pytest

from tfpipe.trainer import input_generator


def _Batches(gen, start_step, n):
  return [(x.numpy(), y.numpy())
          for x, y in gen.GetDataset(start_step).take(n)]


def _AssertSameBatches(a, b):
  assert len(a) == len(b)
  for (xa, ya), (xb, yb) in zip(a, b):
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)


@pytest.mark.parametrize('task', ['copy', 'reverse', 'sort'])
def testSequenceTask(task):
  gen = input_generator.SequenceTaskInput.Params().Set(
      batch_size=4, length=5, vocab_size=10, task=task).Instantiate()
  (x, y), = _Batches(gen, 0, 1)
  assert x.shape == (4, 10) and y.shape == (4, 10)
  assert gen.sequence_length == 10
  src = x[:, :5]
  assert ((src >= 2) & (src < 10)).all()
  np.testing.assert_array_equal(x[:, 5], input_generator.SEP_ID)
  np.testing.assert_array_equal(y[:, :5], -1)
  want = {'copy': src, 'reverse': src[:, ::-1],
          'sort': np.sort(src, axis=1)}[task]
  np.testing.assert_array_equal(y[:, 5:], want)
  # Inputs after SEP are the targets shifted by one (teacher forcing).
  np.testing.assert_array_equal(x[:, 6:], y[:, 5:-1])


@pytest.mark.parametrize('params', [
    input_generator.SequenceTaskInput.Params(),
    input_generator.SyntheticImageInput.Params().Set(image_size=8),
    input_generator.SyntheticClassificationInput.Params(),
])
def testSyntheticIsAPureFunctionOfSeedAndStep(params):
  gen = params.Set(batch_size=8, seed=5).Instantiate()
  full = _Batches(gen, 0, 4)
  _AssertSameBatches(full[3:], _Batches(gen, 3, 1))
  _AssertSameBatches(full, _Batches(params.Instantiate(), 0, 4))
  other = _Batches(params.Copy().Set(seed=6).Instantiate(), 0, 1)
  assert not np.array_equal(other[0][0], full[0][0])


def testImageAndClassificationShapes():
  gen = input_generator.SyntheticImageInput.Params().Set(
      batch_size=6, image_size=12, channels=2, num_classes=5).Instantiate()
  (x, y), = _Batches(gen, 0, 1)
  assert x.shape == (6, 12, 12, 2) and y.shape == (6,)
  assert ((y >= 0) & (y < 5)).all()
  gen = input_generator.SyntheticClassificationInput.Params().Set(
      batch_size=64, input_dim=7, num_classes=3).Instantiate()
  (x, y), = _Batches(gen, 0, 1)
  assert x.shape == (64, 7)
  assert len(np.unique(y)) > 1


def testTFRecordInput(tmp_path):
  rng = np.random.RandomState(0)
  examples = [(rng.randint(0, 9, size=[4]), rng.rand(2).astype(np.float32))
              for _ in range(10)]
  for shard in range(2):
    input_generator.WriteTFRecordExamples(
        str(tmp_path / f'data-{shard}.tfrecord'), examples[shard * 5:][:5])
  p = input_generator.TFRecordInput.Params().Set(
      file_pattern=str(tmp_path / 'data-*.tfrecord'), batch_size=3,
      inputs_shape=[4], targets_shape=[2], targets_dtype='float32',
      shuffle_buffer_size=0)
  gen = p.Instantiate()
  batches = _Batches(gen, 0, 4)
  # 10 examples repeat; batches drop nothing mid-stream and keep file order.
  got = np.concatenate([x for x, _ in batches])
  want = np.array([ex[0] for ex in examples] * 2)[:12]
  np.testing.assert_array_equal(got, want)
  assert batches[0][0].dtype == np.int32 and batches[0][1].dtype == np.float32
  shuffled = p.Copy().Set(shuffle_buffer_size=8, seed=1).Instantiate()
  run = _Batches(shuffled, 0, 5)
  _AssertSameBatches(run, _Batches(shuffled, 0, 5))
  _AssertSameBatches(run[2:], _Batches(shuffled, 2, 3))


def testTextLineInput(tmp_path):
  path = tmp_path / 'data.txt'
  path.write_text('1 2 3 4\n\n5 6 7\t8 9 10\n')
  gen = input_generator.TextLineInput.Params().Set(
      file_pattern=str(path), batch_size=2, sequence_length=3,
      shuffle_buffer_size=0).Instantiate()
  (x, y), = _Batches(gen, 0, 1)
  np.testing.assert_array_equal(x, [[1, 2, 3], [5, 6, 7]])
  np.testing.assert_array_equal(y, [[2, 3, 4], [8, 9, 10]])


def testBadParamsNameTheParam(tmp_path):
  with pytest.raises(ValueError, match='train.task=.shuffle'):
    input_generator.SequenceTaskInput.Params().Set(
        name='train', task='shuffle').Instantiate()
  with pytest.raises(ValueError, match='input.batch_size must be > 0'):
    input_generator.SyntheticClassificationInput.Params().Set(
        batch_size=0).Instantiate()
  gen = input_generator.TFRecordInput.Params().Set(
      file_pattern=str(tmp_path / 'none-*')).Instantiate()
  with pytest.raises(ValueError, match='input.file_pattern=.*matches no files'):
    gen.GetDataset()
