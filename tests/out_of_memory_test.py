"""Tests of tfpipe.out_of_memory: finding the failed allocation.

Protected properties: TensorFlow's own log lines parse into the device, the
shape and the op; an error chain whose head says something else (a
cancelled step) still yields the allocation named deeper in it; a watch of
fd 2 keeps the records, hides the warnings the user did not ask for (and
their continuation lines) and loses no other output, including what is
printed right before it stops; a worker's report round-trips, and outlives
a crash that follows the allocator's refusal (as some TensorFlow kernels
crash), which it records as such; a link planted at a report's fixed path
in /tmp is never followed, by the worker writing or the controller reading.
"""

import json
import os
import signal
import subprocess
import sys

from tests import quiet_test
from tfpipe import local_cluster
from tfpipe import out_of_memory

_RAN_OUT = ('W0000 00:00:1795541764.980780   19803 bfc_allocator.cc:502] '
            'Allocator (bfc_cpu_allocator_for_gpu) ran out of memory trying '
            'to allocate 1.00MiB (rounded to 1048576)requested by op '
            'gradient_tape/cell1_1/fc3_1/MatMul/MatMul_1')
_OOM = ('W0000 00:00:1795541764.981164   19803 op_kernel.cc:1858] '
        'OP_REQUIRES failed at mkl_matmul_op.cc:73 : RESOURCE_EXHAUSTED: OOM '
        'when allocating tensor with shape[512,512] and type float on '
        '/job:worker/replica:0/task:1/device:CPU:0 by allocator '
        'bfc_cpu_allocator_for_gpu')


def test_log_lines_parse_into_device_shape_and_op():
  [record] = out_of_memory.ParseRecords(_RAN_OUT + '\n' + _OOM)
  assert record.device == '/job:worker/replica:0/task:1/device:CPU:0'
  assert (record.shape, record.dtype) == ('512,512', 'float')
  assert record.op == 'gradient_tape/cell1_1/fc3_1/MatMul/MatMul_1'
  assert record.requested == '1.00MiB'
  assert record.Describe() == (
      'a tensor of shape [512,512] (float), 1.00MiB, for op '
      'gradient_tape/cell1_1/fc3_1/MatMul/MatMul_1')
  assert out_of_memory.ParseRecords('RecvAsync is cancelled.') == []


def test_an_error_chain_yields_the_allocation_behind_a_cancelled_step():
  try:
    try:
      raise MemoryError('RESOURCE_EXHAUSTED: ' + _OOM.split('RESOURCE_EXHAUSTED: ')[1])
    except MemoryError as e:
      raise RuntimeError('Graph execution error: RecvAsync is cancelled.') from e
  except RuntimeError as e:
    error = e
  [record] = out_of_memory.FindInError(error)
  assert record.device.endswith('task:1/device:CPU:0')
  assert out_of_memory.IsOutOfMemoryError(error)
  assert not out_of_memory.IsOutOfMemoryError(ValueError('shapes differ'))


_WATCHED = r'''
import json, os, sys
from tfpipe import out_of_memory
watch = out_of_memory.StderrWatch(hide_warnings=True).Start()
os.write(2, b"%s\n%s\n\t [[{{node cell1_1/fc3_1/MatMul}}]]\n" % (
    sys.argv[1].encode(), sys.argv[2].encode()))
os.write(2, b"Hint: If you want to see a list of allocated tensors\n")
os.write(2, b"E0000 00:00:1.0 12 grpc_util.h:104] an error record\n")
print("a line of the program's own", file=sys.stderr)
sys.stderr.write("a partial line without a newline")
watch.Stop()
print(json.dumps([r._asdict() for r in watch.Records()]))
'''


def test_a_watch_keeps_records_and_hides_only_unasked_warnings():
  proc = subprocess.run([sys.executable, '-c', _WATCHED, _RAN_OUT, _OOM],
                        cwd=quiet_test.ROOT, capture_output=True, text=True,
                        timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  [record] = json.loads(proc.stdout)
  assert record['shape'] == '512,512'
  assert record['op'].endswith('MatMul_1')
  assert proc.stderr.splitlines() == [
      'E0000 00:00:1.0 12 grpc_util.h:104] an error record',
      "a line of the program's own", 'a partial line without a newline']


def test_keep_warnings_respects_a_level_the_user_set(monkeypatch):
  monkeypatch.setenv(out_of_memory.LOG_LEVEL_ENV, '2')
  out_of_memory.KeepWarnings(False)
  assert os.environ[out_of_memory.LOG_LEVEL_ENV] == '2'
  monkeypatch.delenv(out_of_memory.LOG_LEVEL_ENV)
  assert out_of_memory.KeepWarnings(True) is out_of_memory.WarningsHidden()
  assert out_of_memory.LOG_LEVEL_ENV not in os.environ
  assert out_of_memory.KeepWarnings(False)
  assert os.environ[out_of_memory.LOG_LEVEL_ENV] == '1'


def test_a_workers_report_is_written_where_its_controller_reads(tmp_path,
                                                               monkeypatch):
  path = out_of_memory.ReportPath('worker', 3, '127.0.0.1:2222')
  assert path == '/tmp/tfpipe-oom-worker-3-2222.jsonl'
  monkeypatch.setattr(out_of_memory, 'ReportPath',
                      lambda *unused: str(tmp_path / 'report.jsonl'))
  report = out_of_memory.WorkerReport('worker', 3, '127.0.0.1:2222')
  [record] = out_of_memory.ParseRecords(_RAN_OUT + '\n' + _OOM)
  report._Write(record)  # pylint: disable=protected-access
  values = json.loads((tmp_path / 'report.jsonl').read_text())
  values.pop('time')
  assert out_of_memory.OutOfMemoryRecord(**values) == record


# What a capped process logged before it crashed converting an eager
# constant (the op's name is empty there), then a line of its own.
_CRASHING_WORKER = r'''
import os, sys
from tfpipe import out_of_memory
report = out_of_memory.StartWorkerReport(
    'worker', 0, 'worker=127.0.0.1:' + sys.argv[1], False)
print(report.path, flush=True)
os.write(2, b'W0000 00:00:1795643264.907878    4852 bfc_allocator.cc:502] '
         b'Allocator (bfc_cpu_allocator_for_gpu) ran out of memory trying to '
         b'allocate 16B (rounded to 256)requested by op \n'
         b'If the cause is memory fragmentation maybe the environment '
         b'variable ... will improve the situation. \n'
         b'a line of the worker\'s own\n')
os.abort()
'''


def test_a_workers_report_outlives_a_crash_after_a_refused_allocation():
  port = local_cluster.FreePorts(1)[0]
  # run() waits for the worker's stderr to close: for its reader too.
  env = {k: v for k, v in os.environ.items()
         if k != out_of_memory.LOG_LEVEL_ENV}  # The default level.
  proc = subprocess.run([sys.executable, '-c', _CRASHING_WORKER, str(port)],
                        cwd=quiet_test.ROOT, capture_output=True, text=True,
                        timeout=60, check=False, env=env)
  path = proc.stdout.strip()
  try:
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    assert path == out_of_memory.ReportPath('worker', 0, f'127.0.0.1:{port}')
    assert out_of_memory.LocalReport('/job:worker/task:0',
                                     f'127.0.0.1:{port}') == [
        out_of_memory.OutOfMemoryRecord(
            device='', shape='?', dtype='?',
            allocator='bfc_cpu_allocator_for_gpu', op='', requested='16B',
            crashed=True)]
    # The warning is hidden, as the user did not ask for warnings; the
    # worker's own last words are not.
    assert proc.stderr.splitlines()[-1:] == ["a line of the worker's own"]
    assert 'ran out of memory' not in proc.stderr
    # Only records written since a time count (a run's own).
    assert out_of_memory.LocalReport('/job:worker/task:0', f'127.0.0.1:{port}',
                                     since=os.path.getmtime(path) + 1) == []
  finally:
    if path and os.path.exists(path):
      os.remove(path)


def test_a_link_at_a_reports_path_is_neither_written_through_nor_read(
    tmp_path, monkeypatch, capfd):
  victim = tmp_path / 'victim'
  victim.write_text('precious\n')
  planted = tmp_path / 'report.jsonl'
  planted.symlink_to(victim)
  monkeypatch.setattr(out_of_memory, 'ReportPath',
                      lambda *unused: str(planted))
  report = out_of_memory.WorkerReport('worker', 0, '127.0.0.1:2222')
  [record] = out_of_memory.ParseRecords(_RAN_OUT + '\n' + _OOM)
  report._Write(record)  # pylint: disable=protected-access
  assert report.path is None
  assert victim.read_text() == 'precious\n'
  assert 'writes no out-of-memory report' in capfd.readouterr().err
  # A report someone else planted does not make a controller claim out of
  # memory.
  victim.write_text(json.dumps({**record._asdict(), 'time': 0}) + '\n')
  assert out_of_memory.LocalReport('/job:worker/task:0',
                                   '127.0.0.1:2222') == []
  planted.unlink()
  planted.write_text(victim.read_text())
  assert out_of_memory.LocalReport('/job:worker/task:0',
                                   '127.0.0.1:2222') == [record]
