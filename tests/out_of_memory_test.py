"""Tests of tfpipe.out_of_memory: finding the failed allocation.

Protected properties: TensorFlow's own log lines parse into the device, the
shape and the op; an error chain whose head says something else (a
cancelled step) still yields the allocation named deeper in it; a watch of
fd 2 keeps the records, hides the warnings the user did not ask for (and
their continuation lines) and loses no other output, including what is
printed right before it stops. (The files the records are kept in:
out_of_memory_reports_test.py.)
"""

import json
import os
import subprocess
import sys

from tests import quiet_test
from tfpipe import out_of_memory

RAN_OUT_LINE = ('W0000 00:00:1795541764.980780   19803 bfc_allocator.cc:502] '
            'Allocator (bfc_cpu_allocator_for_gpu) ran out of memory trying '
            'to allocate 1.00MiB (rounded to 1048576)requested by op '
            'gradient_tape/cell1_1/fc3_1/MatMul/MatMul_1')
OOM_LINE = ('W0000 00:00:1795541764.981164   19803 op_kernel.cc:1858] '
        'OP_REQUIRES failed at mkl_matmul_op.cc:73 : RESOURCE_EXHAUSTED: OOM '
        'when allocating tensor with shape[512,512] and type float on '
        '/job:worker/replica:0/task:1/device:CPU:0 by allocator '
        'bfc_cpu_allocator_for_gpu')


def test_log_lines_parse_into_device_shape_and_op():
  [record] = out_of_memory.ParseRecords(RAN_OUT_LINE + '\n' + OOM_LINE)
  assert record.device == '/job:worker/replica:0/task:1/device:CPU:0'
  assert (record.shape, record.dtype) == ('512,512', 'float')
  assert record.op == 'gradient_tape/cell1_1/fc3_1/MatMul/MatMul_1'
  assert record.requested == '1.00MiB'
  assert record.Describe() == (
      'a tensor of shape [512,512] (float), 1.00MiB, for op '
      'gradient_tape/cell1_1/fc3_1/MatMul/MatMul_1')
  assert out_of_memory.ParseRecords('RecvAsync is cancelled.') == []


def test_a_records_bytes_come_from_the_allocator_else_from_its_shape():
  record = out_of_memory.OutOfMemoryRecord
  assert record('', '?', '?', '', '', '4B').num_bytes == 4
  assert record('', '?', '?', '', '', '256.0KiB').num_bytes == 256 * 1024
  assert record('', '512,512', 'float', '', '', '1.00MiB').num_bytes == 2**20
  assert record('', '512,512', 'float', '', '', '').num_bytes == 2**20
  assert record('', '', 'int64', '', '', '').num_bytes == 8  # a scalar
  assert record('', '3,5', 'variant', '', '', '').num_bytes is None
  assert record('', '?', '?', '', '', '').num_bytes is None
  # A device is full when a request under 1% of its limit is refused.
  assert record('', '?', '?', '', '', '4B').SmallNextTo(24)
  assert not record('', '?', '?', '', '', '1.00MiB').SmallNextTo(24)
  assert not record('', '?', '?', '', '', '4B').SmallNextTo(None)
  assert not record('', '?', '?', '', '', '').SmallNextTo(24)


def test_an_error_chain_yields_the_allocation_behind_a_cancelled_step():
  try:
    try:
      raise MemoryError('RESOURCE_EXHAUSTED: ' + OOM_LINE.split('RESOURCE_EXHAUSTED: ')[1])
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
  proc = subprocess.run([sys.executable, '-c', _WATCHED, RAN_OUT_LINE, OOM_LINE],
                        cwd=quiet_test.ROOT, capture_output=True, text=True,
                        timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  # The refusal, kept as it was logged, then the error's full record.
  refusal, record = json.loads(proc.stdout)
  assert (refusal['shape'], refusal['requested']) == ('?', '1.00MiB')
  assert not refusal['crashed']
  assert record['shape'] == '512,512'
  assert record['op'].endswith('MatMul_1')
  records = [out_of_memory.OutOfMemoryRecord(**r) for r in (refusal, record)]
  assert out_of_memory.MostTelling(records)[0].shape == '512,512'
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


_REFUSED_THEN_OTHER_ERROR = r"""
import json, os, sys, time
from tfpipe import out_of_memory
watch = out_of_memory.StderrWatch(hide_warnings=True).Start()
os.write(2, sys.argv[1].encode() + b"\n")
os.write(2, b"W0000 00:00:1.0 12 remote_tensor_handle_data.cc:81] Unable to "
            b"destroy remote tensor handles: Unable to parse tensor proto\n")
deadline = time.time() + 20
while not watch.Records() and time.time() < deadline:
  time.sleep(0.05)
before_stop = watch.Records()
watch.Stop()
print(json.dumps([[r._asdict() for r in rs]
                  for rs in (before_stop, watch.Records())]))
"""


def test_a_refusal_that_no_oom_error_follows_is_kept_at_once():
  """A worker that cannot allocate a tensor sent to it logs the refusal
  (for no op), then fails as 'Unable to parse tensor proto', and runs on:
  the refusal is the only sign of memory, and must be readable while the
  worker still runs."""
  refusal_line = RAN_OUT_LINE.replace('1.00MiB (rounded to 1048576)',
                                      '4B (rounded to 256)').split(
                                          'requested by op ')[0] + (
                                              'requested by op ')
  proc = subprocess.run(
      [sys.executable, '-c', _REFUSED_THEN_OTHER_ERROR, refusal_line],
      cwd=quiet_test.ROOT, capture_output=True, text=True, timeout=60,
      check=False)
  assert proc.returncode == 0, proc.stderr
  before_stop, after_stop = json.loads(proc.stdout)
  assert before_stop == after_stop  # Stopping adds no crash record.
  [record] = before_stop
  assert (record['shape'], record['requested'], record['op']) == ('?', '4B',
                                                                  '')
  assert record['allocator'] == 'bfc_cpu_allocator_for_gpu'
  assert not record['crashed']


def test_the_most_telling_record_comes_first():
  refusal = out_of_memory.OutOfMemoryRecord('', '?', '?', 'bfc', '', '4B')
  crashed = refusal._replace(op='fc/MatMul', crashed=True)
  full = out_of_memory.OutOfMemoryRecord('/CPU:0', '8,8', 'float', 'bfc',
                                         'fc/MatMul', '256B')
  assert out_of_memory.MostTelling([refusal, crashed, full]) == [
      full, crashed, refusal]
  assert out_of_memory.MostTelling([refusal, refusal]) == [refusal, refusal]
