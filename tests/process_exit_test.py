"""Tests of tfpipe.process_exit: ending a process at once, tidily.

Protected properties: a process that converted functions with autograph and
ends with ExitNow leaves none of autograph's files in its temporary
directory (a plain os._exit leaves them: the control), and its exit status
is the one asked for.
"""

import os
import subprocess
import sys
import textwrap

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent('''
    import os, sys
    from tfpipe import process_exit
    from tfpipe import quiet
    tf = quiet.ImportTensorFlow()

    @tf.function
    def Clip(x):
      if tf.reduce_sum(x) > 0:  # A tensor condition: autograph converts it.
        return x
      return -x

    Clip(tf.constant([1.0, -2.0]))
    assert [n for n in sys.modules
            if n.startswith(process_exit.AUTOGRAPH_PREFIX)], 'no conversion'
    if sys.argv[1] == 'plain':
      os._exit(0)
    process_exit.ExitNow(int(sys.argv[2]))
''')


def _Run(tmp_path, how, status=0):
  # Autograph reads a function's source: the script is a file.
  script = tmp_path / 'converts.py'
  script.write_text(_SCRIPT)
  temporary = tmp_path / 'tmp'
  temporary.mkdir()
  env = dict(os.environ, TMPDIR=str(temporary),
             PYTHONPATH=os.pathsep.join(
                 [_REPO_ROOT] + [p for p in os.environ.get(
                     'PYTHONPATH', '').split(os.pathsep) if p]))
  proc = subprocess.run(
      [sys.executable, str(script), how, str(status)], env=env,
      cwd=_REPO_ROOT, capture_output=True, text=True, timeout=120,
      check=False)
  left = [f for f in os.listdir(temporary)
          if f.startswith('__autograph_generated_file')]
  return proc, left


def test_exit_now_leaves_no_autograph_files(tmp_path):
  proc, left = _Run(tmp_path, 'exit_now', 0)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert left == []


def test_a_plain_os_exit_leaves_them(tmp_path):
  proc, left = _Run(tmp_path, 'plain')
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert left


def test_the_exit_status_is_kept(tmp_path):
  proc, left = _Run(tmp_path, 'exit_now', 4)
  assert proc.returncode == 4, proc.stderr[-2000:]
  assert left == []


def test_a_watchdog_says_so_stops_what_outlives_it_and_exits_3():
  """ExitAfter ends a process that would otherwise hang, with status 3,
  after its `before_exit` (a benchmark's workers) has run."""
  code = textwrap.dedent('''
      import time
      from tfpipe import process_exit
      process_exit.ExitAfter(0.2, lambda: print('workers closed', flush=True))
      time.sleep(60)
      print('never', flush=True)
  ''')
  proc = subprocess.run([sys.executable, '-c', code], cwd=_REPO_ROOT,
                        capture_output=True, text=True, timeout=30,
                        check=False)
  assert proc.returncode == 3, proc.stderr[-2000:]
  assert proc.stdout == (
      'watchdog: run exceeded 0.2s; stopping.\nworkers closed\n')
