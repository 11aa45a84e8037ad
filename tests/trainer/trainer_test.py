"""Tests of the trainer: exact resume after SIGKILL, config errors, inspect modes.

The resume test runs the trainer as a subprocess, kills it with SIGKILL once
a checkpoint exists, restarts it and requires exactly the losses of an
uninterrupted run, both in the printed lines and in the TensorBoard events.
"""

import glob
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from absl import app
import pytest
import tensorflow as tf

from tfpipe import model_registry
from tfpipe.trainer import train_loop
from tfpipe.trainer import trainer

_STEP_RE = re.compile(r'^step (\d+)/\d+ loss=(\S+)')
_FAST_FLAGS = ['--model=mlp.TinyMlp', '--max_steps=20',
               '--save_interval_steps=3', '--log_interval_steps=1',
               '--num_partitions=2', '--num_micro_batches=2', '--seed=5',
               '--run_locally=cpu']


def _Command(logdir, extra=()):
  return [sys.executable, '-m', 'tfpipe.trainer', f'--logdir={logdir}',
          *_FAST_FLAGS, *extra]


def _Env():
  env = dict(os.environ)
  env['TF_CPP_MIN_LOG_LEVEL'] = '3'
  return env


def _StepLosses(text):
  losses = {}
  for line in text.splitlines():
    m = _STEP_RE.match(line)
    if m:
      losses[int(m.group(1))] = m.group(2)
  return losses


def _EventLosses(logdir):
  """{step: [every float32 loss written for it]} from the train events."""
  result = {}
  for path in sorted(glob.glob(os.path.join(logdir, 'train', 'events.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == 'loss':
          result.setdefault(event.step, []).append(
              float(tf.make_ndarray(value.tensor)))
  return result


def _RunToCompletion(logdir, timeout=300):
  out = subprocess.run(_Command(logdir), capture_output=True, text=True,
                       timeout=timeout, env=_Env(), check=False)
  assert out.returncode == 0, out.stdout + out.stderr
  return out.stdout


def _RunAndKill(logdir, kill_after_step, timeout=300):
  """Starts training and SIGKILLs it once `kill_after_step` is printed."""
  proc = subprocess.Popen(_Command(logdir), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=_Env())
  lines = queue.Queue()

  def Reader():
    for line in proc.stdout:
      lines.put(line)
    lines.put(None)

  threading.Thread(target=Reader, daemon=True).start()
  seen = []
  deadline = time.time() + timeout
  try:
    while time.time() < deadline:
      try:
        line = lines.get(timeout=1)
      except queue.Empty:
        continue
      if line is None:
        break
      seen.append(line)
      m = _STEP_RE.match(line)
      if m and int(m.group(1)) >= kill_after_step:
        proc.send_signal(signal.SIGKILL)
        break
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL, ''.join(seen)
  return ''.join(seen)


def testKilledRunResumesWithExactlyTheSameLosses(tmp_path):
  reference = _RunToCompletion(tmp_path / 'reference')
  want = _StepLosses(reference)
  assert sorted(want) == list(range(1, 21))
  assert 'Final: step=20' in reference
  params_txt = (tmp_path / 'reference' / 'params.txt').read_text()
  assert 'task.random_seed : 5' in params_txt

  logdir = tmp_path / 'resumed'
  first = _RunAndKill(logdir, kill_after_step=6)
  assert os.path.exists(logdir / train_loop.CHECKPOINT_DIR / 'checkpoint')
  second = _RunToCompletion(logdir)
  restored = re.search(r'Restored \S+ at step (\d+)', second)
  assert restored, second
  assert 3 <= int(restored.group(1)) < 20
  got = {**_StepLosses(first), **_StepLosses(second)}
  assert got == want
  assert min(_StepLosses(second)) == int(restored.group(1)) + 1
  # Every loss written to TensorBoard, including steps logged twice (before
  # the kill and again after the restore), is bit-identical.
  want_events = _EventLosses(tmp_path / 'reference')
  for step, values in _EventLosses(logdir).items():
    assert values == [want_events[step][0]] * len(values), step
  assert re.search(r'Final: .*eval: accuracy=', second)


def testPartialCheckpointIsNeverRestored(tmp_path):
  p = model_registry.GetParams('mlp.TinyMlp')
  p.task.train.Set(max_steps=8, save_interval_steps=4, log_interval_steps=4)
  p.task.eval.num_batches = 1
  logs = []
  train_loop.Trainer(p, str(tmp_path), log=logs.append).Train()
  ckpt_dir = tmp_path / train_loop.CHECKPOINT_DIR
  assert (ckpt_dir / 'ckpt-8.index').exists()
  # A save killed after writing some files but before the state file.
  (ckpt_dir / 'ckpt-12.index').write_bytes(b'partial')
  (ckpt_dir / 'ckpt-12.data-00000-of-00001').write_bytes(b'')
  resumed = train_loop.Trainer(p, str(tmp_path), log=logs.append)
  assert resumed.RestoreLatest().endswith('ckpt-8')
  assert resumed.step == 8
  assert any(line.startswith('Final: step=8') for line in logs)


@pytest.fixture
def flags_reset():
  yield trainer.FLAGS
  trainer.FLAGS.unparse_flags()


def _Parse(*args):
  trainer.FLAGS.unparse_flags()
  trainer.FLAGS(['tfpipe-train', *args])


@pytest.mark.parametrize('args, message', [
    (['--model=lm.TinyTransformerLM'],
     r"--model: Unknown model 'lm.TinyTransformerLM'. Did you mean "
     r"'lm.TinyTransformerLm'"),
    (['--model_params_override=task.train.learning_rat: 0.1'],
     r"--model_params_override: Unknown param 'task.train.learning_rat'. "
     r"Did you mean '(task.train.)?learning_rate'"),
    (['--model_params_override=task.train.learning_rate: fast'],
     r'--model_params_override: task.train.learning_rate: expected a number'),
    (['--model=mlp.TinyMlp', '--num_micro_batches=64'],
     r'input.batch_size=32 is smaller than task.pipeline.num_micro_batches=64'
     r'.*--num_micro_batches'),
    (['--schedule=zigzag'], r"task.pipeline.schedule='zigzag'.*--schedule"),
    (['--remat_policy=sometimes'], r"remat_policy='sometimes'"),
])
def testBadConfigurationNamesTheFlag(flags_reset, args, message):
  del flags_reset
  _Parse(*args)
  with pytest.raises(app.UsageError, match=message):
    trainer.BuildParams()


def testMorePartitionsThanDevices(flags_reset):
  del flags_reset
  _Parse('--num_partitions=9')
  p = trainer.BuildParams()
  with pytest.raises(app.UsageError,
                     match=r'num_partitions.*9 needs 9 devices.*--num_devices'):
    trainer.CheckDevices(p)


def testTrainNeedsLogdir(flags_reset):
  del flags_reset
  _Parse()
  with pytest.raises(app.UsageError, match='--logdir is required'):
    trainer.main(['tfpipe-train'])


def testInspectParams(flags_reset, capsys):
  del flags_reset
  _Parse('--mode=inspect_params', '--num_partitions=4',
         '--model_params_override=task.train.learning_rate: 0.01')
  trainer.main(['tfpipe-train'])
  text = capsys.readouterr().out
  assert 'task.train.learning_rate : 0.01\n' in text
  assert 'task.pipeline.num_partitions : 4\n' in text
  assert 'model : \'lm.TinyTransformerLm\'\n' in text
  assert 'input.cls : tfpipe.trainer.input_generator.SequenceTaskInput' in text


def testInspectModel(flags_reset, capsys):
  del flags_reset
  _Parse('--mode=inspect_model', '--num_partitions=3', '--nodeterministic')
  trainer.main(['tfpipe-train'])
  text = capsys.readouterr().out
  lines = text.splitlines()
  assert lines[0].startswith('Model lm.TinyTransformerLm: 3 cell(s)')
  cells = [l for l in lines if l.startswith('cell')][1:]
  assert [l.split()[1] for l in cells] == ['/CPU:0', '/CPU:1', '/CPU:2']
  assert 'emb, pos_emb' in cells[0] and cells[-1].endswith('logits')
  assert lines[-1].startswith('total')
  assert '70,160' in lines[-1]


def testUnknownModelExitsCleanly():
  out = subprocess.run(
      [sys.executable, '-m', 'tfpipe.trainer', '--model=lm.Tiny',
       '--logdir=/tmp/unused'],
      capture_output=True, text=True, timeout=120, env=_Env(), check=False)
  assert out.returncode != 0
  assert 'Traceback' not in out.stderr
  assert "--model: Unknown model 'lm.Tiny'" in out.stderr + out.stdout
