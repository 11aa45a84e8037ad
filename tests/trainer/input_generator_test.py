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
def test_sequence_task(task):
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
def test_synthetic_is_a_pure_function_of_seed_and_step(params):
  gen = params.Set(batch_size=8, seed=5).Instantiate()
  full = _Batches(gen, 0, 4)
  _AssertSameBatches(full[3:], _Batches(gen, 3, 1))
  _AssertSameBatches(full, _Batches(params.Instantiate(), 0, 4))
  other = _Batches(params.Copy().Set(seed=6).Instantiate(), 0, 1)
  assert not np.array_equal(other[0][0], full[0][0])


def test_image_and_classification_shapes():
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


def test_tf_record_input(tmp_path):
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


def test_text_line_input(tmp_path):
  path = tmp_path / 'data.txt'
  path.write_text('1 2 3 4\n\n5 6 7\t8 9 10\n')
  gen = input_generator.TextLineInput.Params().Set(
      file_pattern=str(path), batch_size=2, sequence_length=3,
      shuffle_buffer_size=0).Instantiate()
  (x, y), = _Batches(gen, 0, 1)
  np.testing.assert_array_equal(x, [[1, 2, 3], [5, 6, 7]])
  np.testing.assert_array_equal(y, [[2, 3, 4], [8, 9, 10]])


def test_bad_params_name_the_param(tmp_path):
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


def _Translate(source_words, lexicon, two_token, suffix):
  """The translation rule, written out: swap pairs, look up, split words."""
  order = list(source_words)
  for i in range(0, len(order) - 1, 2):
    order[i], order[i + 1] = order[i + 1], order[i]
  result = []
  for word in order:
    result.append(int(lexicon[word]))
    if two_token[word]:
      result.append(suffix)
  return result


def test_translation_task_follows_its_rule():
  gen = input_generator.TranslationTaskInput.Params().Set(
      batch_size=16, num_words=6, min_length=1, max_length=5,
      seed=3).Instantiate()
  assert gen.vocab_size == 16 and gen.suffix_id == 15
  (x, y), = _Batches(gen, 0, 1)
  s, t = gen.source_length, gen.target_length
  assert (s, t) == (5, 11) and x.shape == (16, s + t) and y.shape == (16, t)
  lengths = set()
  for source, decoder_input, target in zip(x[:, :s], x[:, s:], y):
    n = int((source != input_generator.PAD_ID).sum())
    lengths.add(n)
    assert (source[n:] == input_generator.PAD_ID).all()
    want = _Translate(source[:n] - 3, gen.lexicon, gen.two_token, 15)
    m = len(want)
    np.testing.assert_array_equal(target[:m + 1],
                                  want + [input_generator.EOS_ID])
    assert (target[m + 1:] == -1).all()
    np.testing.assert_array_equal(decoder_input[:m + 1],
                                  [input_generator.SEP_ID] + want)
    assert (decoder_input[m + 1:] == input_generator.PAD_ID).all()
  assert len(lengths) > 2  # Lengths vary, so sources are padded.
  assert gen.two_token.sum() == 2  # round(0.25 * 6) words split in two.


def test_translation_task_is_a_pure_function_of_seed_and_step():
  p = input_generator.TranslationTaskInput.Params().Set(batch_size=4, seed=5)
  full = _Batches(p.Instantiate(), 0, 3)
  _AssertSameBatches(full[2:], _Batches(p.Instantiate(), 2, 1))
  other = _Batches(p.Copy().Set(seed=6).Instantiate(), 0, 1)
  assert not np.array_equal(other[0][0], full[0][0])
  with pytest.raises(ValueError, match='min_length <= max_length'):
    p.Copy().Set(min_length=4, max_length=3).Instantiate()


def _WriteSources(root, count):
  for i in range(count):
    path = root / f'pkg{i % 3}' / f'mod{i}.py'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'# module {i}\n' + f'value_{i} = {i}\n' * 20)
  (root / 'site-packages').mkdir()
  (root / 'site-packages' / 'installed.py').write_text('x = 1\n' * 100)


def test_python_source_split_is_deterministic_and_disjoint(tmp_path):
  _WriteSources(tmp_path, 60)
  p = input_generator.PythonSourceTextInput.Params().Set(
      root=str(tmp_path), eval_percent=20, sequence_length=8)
  train = p.Copy().Set(split='train').Instantiate().Files()
  evals = p.Copy().Set(split='eval', seed=9).Instantiate().Files()
  assert train and evals and not set(train) & set(evals)
  assert len(train) + len(evals) == 60  # site-packages is not the stdlib.
  assert all(input_generator.IsEvalFile(f, 20) for f in evals)
  assert 4 <= len(evals) <= 20
  assert evals == p.Copy().Set(split='eval').Instantiate().Files()


def test_python_source_windows(tmp_path):
  _WriteSources(tmp_path, 30)
  p = input_generator.PythonSourceTextInput.Params().Set(
      root=str(tmp_path), eval_percent=20, sequence_length=12, batch_size=4,
      seed=1)
  gen = p.Instantiate()
  corpus = gen.Corpus().tobytes()
  batches = _Batches(gen, 0, 3)
  for x, y in batches:
    assert x.shape == (4, 12) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    for inputs, targets in zip(x, y):
      window = bytes(inputs.astype(np.uint8)) + bytes([targets[-1]])
      assert window in corpus
  _AssertSameBatches(batches[1:], _Batches(p.Instantiate(), 1, 2))
  with pytest.raises(ValueError, match='input.root=.*not a directory'):
    p.Copy().Set(root=str(tmp_path / 'missing')).Instantiate().Files()
  with pytest.raises(ValueError, match='fewer than one example needs'):
    p.Copy().Set(sequence_length=100000).Instantiate().GetDataset()


def test_python_source_default_is_the_standard_library():
  gen = input_generator.PythonSourceTextInput.Params().Set(
      split='eval').Instantiate()
  files = gen.Files()
  assert files and all(f.endswith('.py') for f in files)
  assert all('site-packages' not in f for f in files)
