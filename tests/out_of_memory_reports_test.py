"""Tests of tfpipe.out_of_memory_reports: where out-of-memory records are kept.

Protected properties: a worker's report round-trips, and outlives a crash
that follows the allocator's refusal (as some TensorFlow kernels crash),
which it records as such, while a report without records leaves nothing
in /tmp once its worker is gone (one with records stays for a launcher,
not for a benchmark that read it); a link planted at a report's fixed
path in /tmp is never followed, by the worker writing or the controller
reading (which reads the file the worker holds open, not the name).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile

from tests import out_of_memory_test
from tests import quiet_test
from tfpipe import local_cluster
from tfpipe import out_of_memory
from tfpipe import out_of_memory_reports

RAN_OUT_LINE = out_of_memory_test.RAN_OUT_LINE
OOM_LINE = out_of_memory_test.OOM_LINE


def test_a_workers_report_is_written_where_its_controller_reads(tmp_path,
                                                               monkeypatch):
  path = out_of_memory_reports.ReportPath('worker', 3, '127.0.0.1:2222')
  assert path == '/tmp/tfpipe-oom-worker-3-2222.jsonl'
  monkeypatch.setattr(out_of_memory_reports, 'ReportPath',
                      lambda *unused: str(tmp_path / 'report.jsonl'))
  report = out_of_memory_reports.WorkerReport('worker', 3, '127.0.0.1:2222')
  [record] = out_of_memory.ParseRecords(RAN_OUT_LINE + '\n' + OOM_LINE)
  report._Write(record)  # pylint: disable=protected-access
  values = json.loads((tmp_path / 'report.jsonl').read_text())
  values.pop('time')
  assert out_of_memory.OutOfMemoryRecord(**values) == record


# What a capped process logged before it crashed converting an eager
# constant (the op's name is empty there), then a line of its own.
_CRASHING_WORKER = r'''
import os, sys
from tfpipe import out_of_memory_reports
report = out_of_memory_reports.StartWorkerReport(
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
    assert path == out_of_memory_reports.ReportPath('worker', 0, f'127.0.0.1:{port}')
    # The refusal as it was logged, then, once the log ended, the crash.
    crashed = out_of_memory.OutOfMemoryRecord(
        device='', shape='?', dtype='?',
        allocator='bfc_cpu_allocator_for_gpu', op='', requested='16B',
        crashed=True)
    report = out_of_memory_reports.LocalReport('/job:worker/task:0',
                                               f'127.0.0.1:{port}')
    assert report == [crashed._replace(crashed=False), crashed]
    assert out_of_memory.MostTelling(report)[0] == crashed
    # The warning is hidden, as the user did not ask for warnings; the
    # worker's own last words are not.
    assert proc.stderr.splitlines()[-1:] == ["a line of the worker's own"]
    assert 'ran out of memory' not in proc.stderr
    # Only records written since a time count (a run's own).
    assert out_of_memory_reports.LocalReport('/job:worker/task:0', f'127.0.0.1:{port}',
                                     since=os.path.getmtime(path) + 1) == []
  finally:
    if path and os.path.exists(path):
      os.remove(path)


# A worker that never runs out of memory, and a single process's watch left
# running at exit.
_CLEAN_WORKER = r'''
import sys
from tfpipe import out_of_memory_reports
report = out_of_memory_reports.StartWorkerReport(
    'worker', 0, 'worker=127.0.0.1:' + sys.argv[1], False)
watch = out_of_memory_reports.ProcessWatch().Start()
print(report.path, watch.path, flush=True)
sys.stderr.write('a line of the worker\'s own\n')
'''


def test_reports_without_records_are_gone_once_their_log_ends():
  port = local_cluster.FreePorts(1)[0]
  proc = subprocess.run([sys.executable, '-c', _CLEAN_WORKER, str(port)],
                        cwd=quiet_test.ROOT, capture_output=True, text=True,
                        timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  paths = proc.stdout.split()
  try:
    assert paths[0] == out_of_memory_reports.ReportPath(
        'worker', 0, f'127.0.0.1:{port}')
    assert paths[1].startswith(tempfile.gettempdir())
    assert [p for p in paths if os.path.exists(p)] == []
    assert proc.stderr.splitlines()[-1:] == ["a line of the worker's own"]
  finally:
    for p in paths:
      if os.path.exists(p):
        os.remove(p)


def test_a_launcher_removes_its_workers_reports_except_the_evidence(
    tmp_path, monkeypatch):
  monkeypatch.setattr(
      out_of_memory_reports, 'ReportPath',
      lambda job, task, address: str(tmp_path / f'{job}-{task}.jsonl'))
  jobs = {'worker': ['127.0.0.1:1', '127.0.0.1:2', '127.0.0.1:3'],
          'controller': ['127.0.0.1:4']}
  [record] = out_of_memory.ParseRecords(RAN_OUT_LINE + '\n' + OOM_LINE)
  ran_out = out_of_memory_reports.WorkerReport('worker', 0, jobs['worker'][0])
  ran_out._Write(record)  # pylint: disable=protected-access
  clean = out_of_memory_reports.WorkerReport('worker', 1, jobs['worker'][1])
  victim = tmp_path / 'victim'
  victim.write_text('')
  (tmp_path / 'worker-2.jsonl').symlink_to(victim)
  assert out_of_memory_reports.RemoveReports(jobs) == [
      str(tmp_path / 'worker-0.jsonl')]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      'victim', 'worker-0.jsonl', 'worker-2.jsonl']
  # A worker whose empty report went makes it again with its next record.
  clean._Write(record)  # pylint: disable=protected-access
  assert out_of_memory_reports.LocalReport(
      '/job:worker/task:1', jobs['worker'][1]) == [record]
  # A benchmark that has read its workers' reports keeps none of them.
  assert out_of_memory_reports.RemoveReports(jobs, keep_records=False) == []
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      'victim', 'worker-2.jsonl']
  assert victim.exists()


def _FreeReportFd():
  try:
    os.close(out_of_memory_reports.REPORT_FD)
  except OSError:
    pass


def test_a_controller_reads_the_report_its_worker_holds_not_its_name(
    tmp_path, monkeypatch):
  """A controller reads a report with a ReadFile op run by the worker: of
  the file the worker holds open, so a link or file planted at the name
  (before the worker started: it refuses them) reads as no report."""
  planted = tmp_path / 'report.jsonl'
  monkeypatch.setattr(out_of_memory_reports, 'ReportPath',
                      lambda *unused: str(planted))
  # This process plays the worker: the op runs here.
  monkeypatch.setattr(out_of_memory_reports, '_WorkerDevice',
                      lambda job, task: '/device:CPU:0')
  workers = [('/job:worker/task:0', '127.0.0.1:2222')]
  [record] = out_of_memory.ParseRecords(RAN_OUT_LINE + '\n' + OOM_LINE)
  _FreeReportFd()
  try:
    report = out_of_memory_reports.WorkerReport('worker', 0, '127.0.0.1:2222')
    assert out_of_memory_reports.AskWorkers(workers) == {}
    report._Write(record)  # pylint: disable=protected-access
    assert out_of_memory_reports.AskWorkers(workers) == {
        '/job:worker/task:0': [record]}
    _FreeReportFd()
    planted.unlink()
    forged = tmp_path / 'forged'
    forged.write_text(json.dumps({**record._asdict(), 'time': 4e9}) + '\n')
    planted.symlink_to(forged)
    refused = out_of_memory_reports.WorkerReport('worker', 0,
                                                 '127.0.0.1:2222')
    assert refused.path is None
    assert out_of_memory_reports.AskWorkers(workers) == {}
  finally:
    _FreeReportFd()


def test_a_link_at_a_reports_path_is_neither_written_through_nor_read(
    tmp_path, monkeypatch, capfd):
  victim = tmp_path / 'victim'
  victim.write_text('precious\n')
  planted = tmp_path / 'report.jsonl'
  planted.symlink_to(victim)
  monkeypatch.setattr(out_of_memory_reports, 'ReportPath',
                      lambda *unused: str(planted))
  report = out_of_memory_reports.WorkerReport('worker', 0, '127.0.0.1:2222')
  [record] = out_of_memory.ParseRecords(RAN_OUT_LINE + '\n' + OOM_LINE)
  report._Write(record)  # pylint: disable=protected-access
  assert report.path is None
  assert victim.read_text() == 'precious\n'
  assert 'writes no out-of-memory report' in capfd.readouterr().err
  # A report someone else planted does not make a controller claim out of
  # memory.
  victim.write_text(json.dumps({**record._asdict(), 'time': 0}) + '\n')
  assert out_of_memory_reports.LocalReport('/job:worker/task:0',
                                   '127.0.0.1:2222') == []
  planted.unlink()
  planted.write_text(victim.read_text())
  assert out_of_memory_reports.LocalReport('/job:worker/task:0',
                                   '127.0.0.1:2222') == [record]


def test_after_a_run_records_go_only_if_the_controller_said_them(
    tmp_path, monkeypatch):
  """An out-of-memory stop (status 4) has said what the records hold, so
  they go; after any other end (or none) they are the only evidence, and
  stay for the launcher to name. Empty reports always go."""
  monkeypatch.setattr(
      out_of_memory_reports, 'ReportPath',
      lambda job, task, address: str(tmp_path / f'{job}-{task}.jsonl'))
  jobs = {'worker': ['127.0.0.1:1', '127.0.0.1:2'],
          'controller': ['127.0.0.1:3']}
  [record] = out_of_memory.ParseRecords(RAN_OUT_LINE + '\n' + OOM_LINE)
  for status in (1, None, out_of_memory.EXIT_OUT_OF_MEMORY):
    out_of_memory_reports.WorkerReport(
        'worker', 0, jobs['worker'][0])._Write(record)  # pylint: disable=protected-access
    out_of_memory_reports.WorkerReport('worker', 1, jobs['worker'][1])
    kept = out_of_memory_reports.RemoveAfterRun(jobs, status)
    left = sorted(p.name for p in tmp_path.iterdir())
    if status == out_of_memory.EXIT_OUT_OF_MEMORY:
      assert (kept, left) == ([], [])
    else:
      assert (kept, left) == ([str(tmp_path / 'worker-0.jsonl')],
                              ['worker-0.jsonl'])
