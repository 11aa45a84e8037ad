"""Tests of the trainer's out-of-memory stop (tfpipe.trainer.out_of_memory).

Protected properties: a process whose CPU allocator is capped
(TF_CPU_BFC_MEM_LIMIT_IN_MB), running the pipeline on logical devices,
stops with one ERROR line naming the shared allocator, the device and the
cell whose allocation failed, the limit and the memory model's prediction,
and what to change; its exit status is EXIT_OUT_OF_MEMORY and the
checkpoints it found are untouched. The message's parts are also checked
alone: advice that leaves out what is already set, the checkpoint sentence,
and errors that are not out of memory left alone. A worker lost to the
controller is out of memory when the report it left on this host says its
allocator refused memory (it crashed then), and only then.
"""

import hashlib
import os

import pytest
import tensorflow as tf

from tests import quiet_test
from tfpipe import memory_limit
from tfpipe import model_registry
from tfpipe import out_of_memory as oom_lib
from tfpipe import out_of_memory_reports as oom_reports
from tfpipe.trainer import checkpoint_keeper
from tfpipe.trainer import out_of_memory
from tfpipe.trainer import train_loop

MIB = 2**20


def _Params(**pipeline):
  p = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
  p.task.pipeline.Set(num_partitions=2, **pipeline)
  return p


def _Digests(directory):
  return {name: hashlib.sha256(open(os.path.join(directory, name),
                                    'rb').read()).hexdigest()
          for name in sorted(os.listdir(directory))}


def test_a_capped_process_stops_plainly_and_keeps_its_checkpoints(tmp_path):
  logdir = str(tmp_path / 'lm')
  p = _Params(num_micro_batches=4, remat_policy='always')
  p.task.train.Set(max_steps=2, save_interval_steps=2)
  train_loop.Trainer(p, logdir, log=lambda line: None).Train()
  checkpoints = _Digests(os.path.join(logdir, 'checkpoints'))
  env = memory_limit.CappedEnv(8)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(
      [sys.executable, '-m', 'tfpipe.trainer', '--model=lm.TinyTransformerLm',
       f'--logdir={logdir}', '--run_locally=cpu', '--num_partitions=2',
       '--num_micro_batches=1', '--remat_policy=never', '--max_steps=4',
       '--memory_profile_runs=1'],
      cwd=quiet_test.ROOT, env=env, capture_output=True, text=True,
      timeout=240, check=False)
  assert proc.returncode == out_of_memory.EXIT_OUT_OF_MEMORY, (
      proc.stdout[-2000:] + proc.stderr[-3000:])
  assert 'Traceback' not in proc.stderr
  assert quiet_test.StartupLines(proc.stderr) == []
  [error] = [line for line in proc.stderr.splitlines()
             if line.startswith('ERROR:')]
  assert error.startswith('ERROR: Out of memory in this process, whose 2 '
                          'logical devices share one allocator (on ')
  assert 'which runs cell' in error and 'it could not allocate a tensor' in error
  assert 'The process\'s limit is 8 MiB (TF_CPU_BFC_MEM_LIMIT_IN_MB)' in error
  assert 'the memory model predicted' in error
  assert '--remat_policy=always' in error and '--plan=auto' in error
  assert 'The last good checkpoint' in error and 'ckpt-2' in error
  assert _Digests(os.path.join(logdir, 'checkpoints')) == checkpoints


class _Peak:

  def __init__(self, cells, peak_bytes):
    self.cells, self.peak_bytes, self.device = cells, peak_bytes, cells[0]

  def Describe(self):
    return f'{self.peak_bytes / MIB:.1f} MiB at B0.1'


def test_the_message_names_device_cell_limit_prediction_and_fixes():
  p = _Params(num_micro_batches=4, remat_policy='never', schedule='gpipe')
  diagnosis = out_of_memory.Diagnosis(
      p, ['/job:worker/replica:0/task:0/device:CPU:0',
          '/job:worker/replica:0/task:1/device:CPU:0'], limit_mb=24,
      predict=lambda: [_Peak([0], 10 * MIB), _Peak([1], 31 * MIB)],
      last_good=lambda: out_of_memory.LastGood('/l/checkpoints/ckpt-20'))
  record = oom_lib.OutOfMemoryRecord(
      '/job:worker/replica:0/task:1/device:CPU:0', '64,32,512', 'float',
      'bfc', 'cell1_1/block_2/ffn/MatMul', '4.00MiB')
  message = diagnosis.Message(record)
  assert message.startswith(
      'Out of memory on /job:worker/replica:0/task:1/device:CPU:0, which '
      'runs cell1 (block_1, final_ln, logits): it could not allocate a '
      'tensor of shape [64,32,512] (float), 4.00MiB, for op '
      'cell1_1/block_2/ffn/MatMul.')
  assert ('Its limit is 24 MiB; the memory model predicted 31.0 MiB at '
          'B0.1.') in message
  assert ('To fit, try more partitions (--num_partitions=4), '
          '--remat_policy=always, more micro-batches (--num_micro_batches=8), '
          '--schedule=1f1b, --balance=memory, or --plan=auto with '
          '--device_memory_mb.') in message
  assert message.endswith('The last good checkpoint, /l/checkpoints/ckpt-20, '
                          'is kept.')
  assert 'already full' not in message
  # A scalar refused: the device was full before it, which the line says.
  small = diagnosis.Message(record._replace(shape='', requested='4B'))
  assert ('it could not allocate a tensor of shape [] (float), 4B, for op '
          'cell1_1/block_2/ffn/MatMul. That request is small next to the '
          'limit: the device was already full. Its limit is 24 MiB') in small


def test_a_lost_worker_whose_report_shows_a_refusal_ran_out_of_memory(
    tmp_path, monkeypatch):
  monkeypatch.setattr(oom_reports, 'ReportPath', lambda job, task, address: str(
      tmp_path / f'{job}-{task}-{address.rsplit(":", 1)[1]}.jsonl'))
  oom_reports.WorkerReport('worker', 0, '127.0.0.1:2222')._Write(  # pylint: disable=protected-access
      oom_lib.OutOfMemoryRecord('', '?', '?', 'bfc', '', '1.00MiB',
                                crashed=True))  # Before the run: stale.
  diagnosis = out_of_memory.Diagnosis(
      _Params(num_micro_batches=4, remat_policy='always'),
      ['/job:worker/replica:0/task:0/device:CPU:0',
       '/job:worker/replica:0/task:1/device:CPU:0'], limit_mb=24,
      predict=lambda: [_Peak([0], 10 * MIB), _Peak([1], 31 * MIB)],
      last_good=lambda: out_of_memory.LastGood('/l/checkpoints/ckpt-20'))
  assert diagnosis.ExplainLostWorker('/job:worker/task:0',
                                     '127.0.0.1:2222') is None
  assert diagnosis.ExplainLostWorker('/job:worker/task:1',
                                     '127.0.0.1:2223') is None  # No report.
  # What the reader of a worker that crashed after a refusal writes.
  oom_reports.WorkerReport('worker', 1, '127.0.0.1:2223')._Write(  # pylint: disable=protected-access
      oom_lib.OutOfMemoryRecord('', '?', '?', 'bfc',
                                'cell1_1/block_1/ffn/MatMul', '1.00MiB',
                                crashed=True))
  message, status = diagnosis.ExplainLostWorker('/job:worker/task:1',
                                                '127.0.0.1:2223')
  assert status == out_of_memory.EXIT_OUT_OF_MEMORY
  assert message.startswith(
      'Out of memory on /job:worker/replica:0/task:1/device:CPU:0, which '
      'runs cell1 (block_1, final_ln, logits): it could not allocate '
      '1.00MiB, for op cell1_1/block_1/ffn/MatMul. Its worker process '
      '(/job:worker/task:1 at 127.0.0.1:2223) then crashed')
  assert 'Its limit is 24 MiB; the memory model predicted 31.0 MiB' in message
  assert '--num_partitions=4' in message
  assert message.endswith('The last good checkpoint, /l/checkpoints/ckpt-20, '
                          'is kept.')


@pytest.mark.parametrize('answers', [True, False],
                         ids=['worker-answers', 'read-from-disk'])
def test_a_workers_refusal_explains_an_error_that_does_not_say_memory(
    answers, tmp_path, monkeypatch):
  """A tensor sent to a worker that cannot allocate it fails the step as
  'Unable to parse tensor proto'; the worker's report holds only its
  allocator's refusal (for no op), and that is enough. A worker out of
  memory may not answer (its reply needs memory): then its report is read
  from this host's disk."""
  monkeypatch.setattr(oom_reports, 'ReportPath', lambda job, task, address: str(
      tmp_path / f'{job}-{task}-{address.rsplit(":", 1)[1]}.jsonl'))
  refusal = oom_lib.OutOfMemoryRecord('', '?', '?', 'bfc_cpu_allocator_for_gpu',
                                      '', '4B', crashed=False)
  diagnosis = out_of_memory.Diagnosis(
      _Params(num_micro_batches=4, remat_policy='always'),
      ['/job:worker/replica:0/task:0/device:CPU:0',
       '/job:worker/replica:0/task:1/device:CPU:0'], limit_mb=25,
      workers=[('/job:worker/task:0', '127.0.0.1:2222'),
               ('/job:worker/task:1', '127.0.0.1:2223')])
  if answers:
    monkeypatch.setattr(oom_reports, 'AskWorkers', lambda workers, since: {
        '/job:worker/task:1': [refusal]})
  else:
    monkeypatch.setattr(oom_reports, 'AskWorkers',
                        lambda workers, since: {})
  # Written during the run (a report from before it would be stale).
  oom_reports.WorkerReport('worker', 1, '127.0.0.1:2223')._Write(refusal)  # pylint: disable=protected-access
  error = ValueError('pipe: cell 1 (cell1) failed on the pipeline input. '
                     'Cause: InvalidArgumentError: Unable to parse tensor '
                     'proto')
  stop = diagnosis.Check(error)
  assert isinstance(stop, out_of_memory.OutOfMemoryStop)
  assert str(stop).startswith(
      'Out of memory on /job:worker/replica:0/task:1/device:CPU:0, which '
      'runs cell1 (block_1, final_ln, logits): it could not allocate 4B.')
  assert 'Its limit is 25 MiB' in str(stop)
  monkeypatch.setattr(oom_reports, 'AskWorkers', lambda workers, since: {})
  os.remove(oom_reports.ReportPath('worker', 1, '127.0.0.1:2223'))
  assert diagnosis.Check(error) is None  # No refusal: not out of memory.


class _RestoreRunsOutOfMemory:
  """A tf.train.Checkpoint whose restore fails as a full device does."""

  def __init__(self, checkpoint):
    self.save_counter = checkpoint.save_counter

  def restore(self, unused_path):
    raise tf.errors.ResourceExhaustedError(
        None, None, 'OOM when allocating tensor with shape[256,1024] and type '
        'float on /job:worker/replica:0/task:1/device:CPU:0 by allocator '
        'bfc_cpu_allocator_for_gpu')


def test_a_restore_that_runs_out_of_memory_is_not_called_a_misfit(tmp_path):
  """The keeper calls any failed restore a checkpoint that does not fit;
  when a device ran out of memory the run must say that instead (and
  status 4), while a real misfit still stops as one."""
  checkpoint = tf.train.Checkpoint(v=tf.Variable(tf.ones([4])))
  keeper = checkpoint_keeper.CheckpointKeeper(checkpoint, str(tmp_path), 2)
  keeper.save(1)
  diagnosis = out_of_memory.Diagnosis(
      _Params(num_micro_batches=4, remat_policy='always'),
      ['/job:worker/replica:0/task:0/device:CPU:0',
       '/job:worker/replica:0/task:1/device:CPU:0'], limit_mb=25)
  full = checkpoint_keeper.CheckpointKeeper(
      _RestoreRunsOutOfMemory(checkpoint), str(tmp_path), 2)
  with pytest.raises(checkpoint_keeper.CheckpointMismatchError) as raised:
    full.RestoreNewest()
  stop = diagnosis.Stop(raised.value, train_loop.STOP_ERRORS)
  assert isinstance(stop, out_of_memory.OutOfMemoryStop)
  assert str(stop).startswith(
      'Out of memory on /job:worker/replica:0/task:1/device:CPU:0, which '
      'runs cell1 (block_1, final_ln, logits): it could not allocate a '
      'tensor of shape [256,1024] (float).')
  misfit = checkpoint_keeper.CheckpointMismatchError(
      str(tmp_path / 'ckpt-1'), 'Shapes [4] and [5] are incompatible.')
  assert diagnosis.Stop(misfit, train_loop.STOP_ERRORS) is misfit
  assert diagnosis.Stop(ValueError('shapes differ'),
                        train_loop.STOP_ERRORS) is None


def test_advice_leaves_out_what_is_already_set():
  p = _Params(num_micro_batches=8, remat_policy='always', balance='memory')
  advice = out_of_memory.Advice(p.task.pipeline)
  assert '--remat_policy' not in advice and '--balance' not in advice
  assert '--num_micro_batches=16' in advice


def test_a_planned_run_is_told_to_leave_more_headroom():
  """A run whose settings --plan=auto chose is not told to change them by
  hand (the next plan would undo it), but to plan with more room."""
  p = _Params(num_micro_batches=4, remat_policy='never')
  diagnosis = out_of_memory.Diagnosis(
      p, ['/job:worker/replica:0/task:0/device:CPU:0'], limit_mb=19,
      plan_headroom=0.15)
  record = oom_lib.OutOfMemoryRecord(
      '/job:worker/replica:0/task:0/device:CPU:0', '512,512', 'float',
      'bfc', '', '1.00MiB')
  message = diagnosis.Message(record)
  assert ('The plan left 15% of each device free (--plan_headroom), which '
          'was not enough here: a larger one (--plan_headroom=0.25) makes '
          '--plan=auto choose a plan with more room, or give more memory or '
          'devices.') in message
  assert '--num_partitions' not in message
  assert 'plan_headroom=0.9)' in out_of_memory.Advice(p.task.pipeline,
                                                        plan_headroom=0.85)


def test_checkpoint_sentence_and_other_errors(tmp_path):
  assert out_of_memory.LastGood(None) == 'No checkpoint was written or changed.'
  (tmp_path / 'ckpt-3.index').write_text('')
  (tmp_path / 'ckpt-12.index').write_text('')
  assert out_of_memory.LastGood(None, str(tmp_path)) == (
      f'The checkpoints in {tmp_path} (the newest ckpt-12) were not touched.')
  diagnosis = out_of_memory.Diagnosis(_Params(), ['/CPU:0', '/CPU:1'])
  assert diagnosis.Check(ValueError('shapes (2, 3) and (4,) differ')) is None
