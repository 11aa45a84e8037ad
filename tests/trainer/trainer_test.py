"""Tests of the trainer: exact resume after SIGKILL, config errors, inspect modes.

The resume test runs the trainer as a subprocess, kills it with SIGKILL once
a checkpoint exists, restarts it and requires exactly the losses of an
uninterrupted run, both in the printed lines and in the TensorBoard events.
"""
# bazel: deps=//params,//tfpipe/trainer:__main__

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
from absl import flags
import numpy as np
import pytest
import tensorflow as tf

from tests import quiet_test
from tfpipe import devices
from tfpipe import model_registry
from tfpipe.trainer import input_generator
from tfpipe.trainer import train_loop
from tfpipe.trainer import trainer

_STEP_RE = re.compile(r'^step (\d+)/\d+ loss=(\S+)')
_FAST_FLAGS = ['--model=mlp.TinyMlp', '--max_steps=20',
               '--save_interval_steps=3', '--log_interval_steps=1',
               '--num_partitions=2', '--num_micro_batches=2', '--seed=5',
               '--run_locally=cpu']


def _Args(logdir, extra=()):
  return ['-m', 'tfpipe.trainer', f'--logdir={logdir}', *_FAST_FLAGS, *extra]


def _Command(logdir, extra=()):
  return [sys.executable, *_Args(logdir, extra)]


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


def _StartRun(logdir, timeout=300):
  """Training to the end, started (quiet_test.Started)."""
  return quiet_test.Started(*_Args(logdir), timeout=timeout, env=_Env())


def _Stdout(completed):
  assert completed.returncode == 0, completed.stdout + completed.stderr
  return completed.stdout


def _RunAndSignal(logdir, after_step, sig=signal.SIGKILL, timeout=300):
  """Starts training and sends `sig` once `after_step` is printed; returns
  (what it printed, its exit status)."""
  proc = subprocess.Popen(_Command(logdir), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=_Env())
  lines = queue.Queue()

  def Reader():
    for line in proc.stdout:
      lines.put(line)
    lines.put(None)

  threading.Thread(target=Reader, daemon=True).start()
  seen = []
  sent = False
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
      if not sent and m and int(m.group(1)) >= after_step:
        proc.send_signal(sig)
        sent = True
        if sig == signal.SIGKILL:
          break
  finally:
    if proc.poll() is None and (sig == signal.SIGKILL or
                                time.time() >= deadline):
      proc.kill()
    proc.wait(timeout=60)
  return ''.join(seen), proc.returncode


def _RunAndKill(logdir, kill_after_step, timeout=300):
  """Starts training and SIGKILLs it once `kill_after_step` is printed."""
  text, code = _RunAndSignal(logdir, kill_after_step, timeout=timeout)
  assert code == -signal.SIGKILL, text
  return text


def test_sigterm_saves_the_step_it_ends_and_exits_143(tmp_path):
  # One process (no launcher): a scheduler's SIGTERM ends the run after its
  # step, with a checkpoint of it, and the status of a SIGTERM.
  text, code = _RunAndSignal(tmp_path, after_step=4, sig=signal.SIGTERM)
  assert code == 128 + signal.SIGTERM, text
  stopped = re.search(r'^SIGTERM received: stopped after step (\d+); '
                      r'(\S+)ckpt-(\d+) holds it\.', text, re.MULTILINE)
  assert stopped and stopped.group(1) == stopped.group(3), text
  step = int(stopped.group(1))
  assert 4 <= step < 20 and max(_StepLosses(text)) == step, text
  assert tf.train.latest_checkpoint(
      str(tmp_path / train_loop.CHECKPOINT_DIR)).endswith(f'ckpt-{step}')
  assert 'Final:' not in text


def test_killed_run_resumes_with_exactly_the_same_losses(tmp_path):
  logdir = tmp_path / 'resumed'
  first = _RunAndKill(logdir, kill_after_step=6)
  assert os.path.exists(logdir / train_loop.CHECKPOINT_DIR / 'checkpoint')
  # The restart and the uninterrupted reference run, started together
  # (each uses about a core).
  reference, second = map(_Stdout, quiet_test.RunAll(
      _StartRun(tmp_path / 'reference'), _StartRun(logdir)))
  want = _StepLosses(reference)
  assert sorted(want) == list(range(1, 21))
  assert 'Final: step=20' in reference
  params_txt = (tmp_path / 'reference' / 'params.txt').read_text()
  assert 'task.random_seed : 5' in params_txt

  # The killed run's lock is taken over, saying whose it was.
  assert re.search(r'Took over the lock of \S+ left by pid \d+ on host ',
                   second), second
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


def test_partial_checkpoint_is_never_restored(tmp_path):
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
    (['--schedule=zigzag'],
     r"task.pipeline.schedule must be .*--schedule.*Received: schedule='zigzag'"),
    (['--remat_policy=sometimes'], r"remat_policy='sometimes'"),
])
def test_bad_configuration_names_the_flag(flags_reset, args, message):
  del flags_reset
  _Parse(*args)
  with pytest.raises(app.UsageError, match=message):
    trainer.BuildParams()


def test_more_partitions_than_devices(flags_reset):
  del flags_reset
  _Parse('--num_partitions=9')
  p = trainer.BuildParams()
  with pytest.raises(app.UsageError,
                     match=r'num_partitions x num_replicas = 9 devices.*--num_devices'):
    trainer.CheckDevices(p)


def test_num_devices_below_partitions_times_replicas_names_both(flags_reset):
  # It used to say that TensorFlow had started with too few devices.
  del flags_reset
  _Parse('--num_devices=1', '--num_partitions=2')
  p = trainer.BuildParams()
  with pytest.raises(app.UsageError) as e:
    trainer.CheckDevices(p)
  assert str(e.value).startswith(
      '--num_devices=1 is below task.pipeline.num_partitions x num_replicas '
      '= 2 x 1 = 2: ')
  _Parse('--num_devices=2', '--num_partitions=4', '--schedule=interleaved_1f1b')
  # Round-robin placement shares devices: no refusal.
  assert len(trainer.CheckDevices(trainer.BuildParams())) == 4


@pytest.mark.parametrize('num_heads, message', [
    (3, r'atten: num_heads=3 does not divide the attention width 64'),
    (-4, r'atten: num_heads must be an int > 0; received num_heads=-4.')])
def test_bad_model_params_stop_before_the_logdir_is_touched(
    flags_reset, tmp_path, num_heads, message):
  # num_heads=3 was a traceback; -4 wrote params.txt, then failed at step 1.
  del flags_reset
  logdir = tmp_path / 'lm'
  _Parse(f'--logdir={logdir}', '--run_locally=cpu',
         f'--model_params_override=task.model.num_heads: {num_heads}')
  with pytest.raises(app.UsageError,
                     match=r'^task.model of --model=lm.TinyTransformerLm: .*'
                     + message):
    trainer.main(['tfpipe-train'])
  assert not logdir.exists()


def test_train_needs_logdir(flags_reset):
  del flags_reset
  _Parse()
  with pytest.raises(app.UsageError, match='--logdir is required'):
    trainer.main(['tfpipe-train'])


def test_inspect_params(flags_reset, capsys):
  del flags_reset
  _Parse('--mode=inspect_params', '--num_partitions=4',
         '--model_params_override=task.train.learning_rate: 0.01')
  trainer.main(['tfpipe-train'])
  text = capsys.readouterr().out
  assert 'task.train.learning_rate : 0.01\n' in text
  assert 'task.pipeline.num_partitions : 4\n' in text
  assert 'model : \'lm.TinyTransformerLm\'\n' in text
  assert 'input.cls : tfpipe.trainer.input_generator.SequenceTaskInput' in text


def test_inspect_params_with_docs_round_trips(flags_reset, capsys):
  del flags_reset
  _Parse('--mode=inspect_params', '--params_docs')
  trainer.main(['tfpipe-train'])
  text = capsys.readouterr().out
  assert ('# Peak learning rate, scaled by lr_schedule.\n'
          'task.train.learning_rate : 0.003\n') in text
  # The # lines are comments: the text still reads back as the params.
  p = model_registry.GetParams('lm.TinyTransformerLm')
  q = p.Copy()
  q.FromText(text.split('# trainable parameters')[0])
  assert q == p


def test_inspect_model(flags_reset, capsys):
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


def test_unknown_model_exits_cleanly():
  out = subprocess.run(
      [sys.executable, '-m', 'tfpipe.trainer', '--model=lm.Tiny',
       '--logdir=/tmp/unused'],
      capture_output=True, text=True, timeout=120, env=_Env(), check=False)
  assert out.returncode != 0
  assert 'Traceback' not in out.stderr
  assert "--model: Unknown model 'lm.Tiny'" in out.stderr + out.stdout


def test_list_models_names_each_experiment_with_its_docstring(flags_reset,
                                                             capsys):
  del flags_reset
  _Parse('--mode=list_models')
  assert trainer.main(['tfpipe-train']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert sorted(line.split()[0] for line in lines) == (
      model_registry.ListModels())
  assert any(re.fullmatch(r'lm.TinyTransformerLm +2 blocks of width 64, .*',
                          line) for line in lines), lines


_TFRECORD_EXPERIMENT = """\
from params import mlp
from tfpipe.trainer import input_generator


class Mlp(mlp.TinyMlp):
  \"\"\"TinyMlp on the user's TFRecords, whose paths come from the command line.\"\"\"

  def Train(self):
    return input_generator.TFRecordInput.Params().Set(
        name='train', batch_size=32, seed=0, inputs_shape=[16],
        inputs_dtype='float32', targets_shape=[], targets_dtype='int32')
"""


def test_eval_input_left_empty_is_refused_before_training(
    flags_reset, tmp_path, monkeypatch):
  # A TFRecordInput user overrides input.file_pattern only; the eval input,
  # made from Train() by Test(), keeps the empty pattern. That used to fail
  # after training, naming the internal 'test.file_pattern'.
  del flags_reset
  package = f'user_exp_{tmp_path.name.replace("-", "_")}'
  (tmp_path / package).mkdir()
  (tmp_path / package / '__init__.py').write_text('')
  (tmp_path / package / 'experiments.py').write_text(_TFRECORD_EXPERIMENT)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(model_registry, '_REGISTRY',
                      dict(model_registry._REGISTRY))  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  input_generator.WriteTFRecordExamples(
      str(tmp_path / 'train-00000.tfrecord'),
      [(rng.normal(size=16).astype(np.float32), i % 4) for i in range(64)])
  logdir = tmp_path / 'run'
  args = [f'--model={package}.experiments.Mlp', f'--logdir={logdir}',
          '--nodeterministic', '--run_locally=cpu']
  _Parse(*args, '--model_params_override=input.file_pattern: '
         f'"{tmp_path}/train-*"')
  with pytest.raises(app.UsageError,
                     match=r"^eval_input.file_pattern='' matches no files"):
    trainer.main(['tfpipe-train'])
  assert not (logdir / train_loop.CHECKPOINT_DIR).exists()
  # With both patterns set, the inputs pass.
  _Parse(*args, '--model_params_override=input.file_pattern: '
         f'"{tmp_path}/train-*"; eval_input.file_pattern: "{tmp_path}/train-*"')
  trainer.CheckInputs(trainer.BuildParams(), 'train')


@pytest.mark.parametrize('flag', [
    '--num_devices=-1', '--eval_interval_steps=-1', '--num_partitions=0',
    '--max_steps=0', '--max_nan_skips=-1'])
def test_negative_counts_are_refused_when_flags_are_parsed(flags_reset, flag):
  del flags_reset
  with pytest.raises(flags.IllegalFlagValueError, match=flag.split('=')[0]):
    _Parse(flag)


def test_negative_eval_interval_param_names_it(flags_reset):
  del flags_reset
  _Parse('--model_params_override=task.eval.interval_steps: -3')
  with pytest.raises(app.UsageError,
                     match=r'task.eval.interval_steps must be >= 0.*-3 '
                     r'\(--eval_interval_steps\)'):
    trainer.BuildParams()


def test_more_partitions_than_layers_is_a_usage_error(flags_reset):
  del flags_reset
  _Parse('--num_partitions=100', '--logdir=/tmp/unused', '--mode=eval')
  with pytest.raises(app.UsageError,
                     match=r'^Cannot cut 6 layers into num_partitions=100 .*'
                     r'--num_partitions'):
    trainer.main(['tfpipe-train'])


def test_unusable_logdir_is_a_usage_error(flags_reset, tmp_path):
  del flags_reset
  a_file = tmp_path / 'file'
  a_file.write_text('not a directory')
  for logdir, message in ((a_file, 'is a file, not a directory'),
                          (a_file / 'run', f'lies under {a_file}')):
    _Parse(f'--logdir={logdir}')
    with pytest.raises(app.UsageError, match=message):
      trainer.main(['tfpipe-train'])


@pytest.mark.parametrize('args', [
    ['--balance=2,4'], ['--balance=[2, 4]'],
    ['--model_params_override=task.pipeline.balance: [2, 4]']])
def test_balance_list_from_the_command_line(flags_reset, capsys, args):
  del flags_reset
  _Parse('--mode=inspect_model', '--num_partitions=2', '--nodeterministic',
         *args)
  trainer.main(['tfpipe-train'])
  cells = [l for l in capsys.readouterr().out.splitlines()
           if l.startswith('cell') and '/CPU:' in l]
  assert [len(l.split('  ')[-1].split(', ')) for l in cells] == [2, 4]


def test_unreadable_checkpoints_are_one_error_line(flags_reset, tmp_path,
                                                   capsys):
  del flags_reset
  checkpoints = tmp_path / train_loop.CHECKPOINT_DIR
  checkpoints.mkdir()
  (checkpoints / 'ckpt-3.index').write_bytes(b'not an index')
  (checkpoints / 'ckpt-3.data-00000-of-00001').write_bytes(b'not data')
  _Parse(f'--logdir={tmp_path}', '--model=mlp.TinyMlp', '--run_locally=cpu',
         '--nodeterministic')
  (tmp_path / 'params.txt').write_text(trainer.BuildParams().ToText())
  assert trainer.main(['tfpipe-train']) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      f'ERROR: No checkpoint in {checkpoints} reads back: ckpt-3: ')
  assert sorted(os.listdir(checkpoints)) == [
      'ckpt-3.data-00000-of-00001', 'ckpt-3.index']


# ---- devices and start-up output ---------------------------------------------

def _StartQuietly(*args):
  return quiet_test.Started('-m', 'tfpipe.trainer', *args, timeout=180)


def test_startup_prints_no_tensorflow_noise_unless_verbosity_asks(tmp_path):
  # Four independent processes, started together (each uses about a core).
  inspect, train, info, verbose = quiet_test.RunAll(
      _StartQuietly('--mode=inspect_params'),
      _StartQuietly(f'--logdir={tmp_path}', '--model=mlp.TinyMlp',
                    '--max_steps=2', '--log_interval_steps=1',
                    '--num_partitions=2', '--run_locally=cpu'),
      _StartQuietly('--mode=inspect_params', '--verbosity=0'),
      _StartQuietly('--mode=inspect_params', '--verbosity=1'))
  assert inspect.returncode == 0, inspect.stderr
  assert quiet_test.StartupLines(inspect.stdout + inspect.stderr) == []
  assert inspect.stderr == ''
  # The size comes from the cost models, so it is printed without building.
  assert inspect.stdout.splitlines()[-1] == '# trainable parameters: 70,160'
  assert train.returncode == 0, train.stderr
  assert quiet_test.StartupLines(train.stdout + train.stderr) == []
  assert train.stdout.startswith('Training mlp.TinyMlp in ')
  assert 'Final: step=2' in train.stdout
  assert quiet_test.StartupLines(info.stdout + info.stderr) == []
  assert verbose.returncode == 0, verbose.stderr
  assert quiet_test.StartupLines(verbose.stderr), verbose.stderr


@pytest.fixture
def one_gpu(monkeypatch):
  """tf.config seen by tfpipe.devices: one H100 that is not started yet."""
  from tests import devices_test  # pylint: disable=g-import-not-at-top
  config = devices_test._FakeConfig()  # pylint: disable=protected-access
  monkeypatch.setattr(devices, '_Config', lambda: config)
  monkeypatch.setattr(devices, 'CudaTotalMemoryMb', lambda n: 81559)
  return config


@pytest.mark.parametrize('args, count, each', [
    ([], 2, devices.UsableGpuMemoryMb(81559) // 2),
    (['--num_devices=4'], 4, devices.UsableGpuMemoryMb(81559) // 4),
    (['--logical_gpu_memory_mb=30000'], 2, 30000)])
def test_one_gpu_is_split_for_two_partitions_and_the_trainer_says_so(
    flags_reset, capsys, one_gpu, args, count, each):
  del flags_reset
  _Parse('--num_partitions=2', '--nodeterministic', *args)
  split = trainer.ConfigureDevices(trainer.BuildParams())
  assert split.counts == (count,) and split.memory_limit_mb == each
  gpu = one_gpu.gpus[0]
  assert one_gpu.calls == [
      ('set_visible_devices', [gpu], 'GPU'),
      ('set_logical_device_configuration', gpu,
       [tf.config.LogicalDeviceConfiguration(memory_limit=each)] * count)]
  lines = capsys.readouterr().out.splitlines()
  why = (args[0] if args and 'num_devices' in args[0] else
         'task.pipeline.num_partitions x num_replicas = 2')
  assert lines == [f'Split GPU:0 into {count} logical GPUs of {each} MiB '
                   f'each ({why}; ' + lines[0].split('; ', 1)[1]]
  assert len(lines) == 1


def test_num_devices_default_is_partitions_times_replicas(flags_reset):
  del flags_reset
  _Parse('--num_partitions=3', '--num_replicas=2')
  assert trainer.NumDevicesNeeded(trainer.BuildParams()) == (
      6, 'task.pipeline.num_partitions x num_replicas = 6')


def test_gpu_asked_for_on_a_machine_without_one_is_a_usage_error(flags_reset):
  del flags_reset
  if tf.config.list_physical_devices('GPU'):
    pytest.skip('This machine has a GPU.')
  _Parse('--run_locally=gpu', '--nodeterministic')
  with pytest.raises(app.UsageError,
                     match=r'^--run_locally=gpu but no GPU is visible; use '
                     r'--run_locally=cpu'):
    trainer.ConfigureDevices(trainer.BuildParams())


def test_logical_gpu_memory_on_a_cpu_run_is_a_usage_error(flags_reset):
  del flags_reset
  _Parse('--run_locally=cpu', '--logical_gpu_memory_mb=100',
         '--nodeterministic')
  with pytest.raises(app.UsageError, match=r'--logical_gpu_memory_mb=100 sets '
                     r'the memory of logical GPUs, but this run is on the CPU'):
    trainer.ConfigureDevices(trainer.BuildParams())


def test_cpu_run_in_a_started_process_keeps_enough_devices(flags_reset,
                                                           capsys):
  del flags_reset
  assert len(tf.config.list_logical_devices('CPU')) == 8  # Started.
  _Parse('--run_locally=cpu', '--num_partitions=4', '--nodeterministic')
  assert trainer.ConfigureDevices(trainer.BuildParams()) is None
  assert capsys.readouterr().out == ''
  _Parse('--run_locally=cpu', '--num_devices=9', '--nodeterministic')
  with pytest.raises(app.UsageError, match=r'^9 CPU devices are needed but '
                     r'TensorFlow has already started with 8'):
    trainer.ConfigureDevices(trainer.BuildParams())
