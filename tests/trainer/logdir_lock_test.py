"""Tests of tfpipe.trainer.logdir_lock: one trainer per logdir, crash-safe.

Protected properties: a second holder is refused with the first one's pid
and host; a holder killed with SIGKILL leaves a lock that the next trainer
takes over, saying so; an orderly release leaves nothing to take over; an
unusable logdir (a file, under a file, unwritable) is a LogdirError naming
it; a lock file that is a link (even a dangling one), not a regular file,
another user's, or hard-linked is refused, and the file it stands for is
neither truncated nor created.
"""

import os
import signal
import socket
import subprocess
import sys

import pytest

from tfpipe.trainer import logdir_lock

_HOLD_AND_SLEEP = (
    'import sys, time\n'
    'from tfpipe.trainer import logdir_lock\n'
    'logdir_lock.LogdirLock(sys.argv[1]).Acquire()\n'
    'print("locked", flush=True)\n'
    'time.sleep(120)\n')


def test_second_holder_is_refused_with_the_first_ones_pid_and_host(tmp_path):
  logs = []
  with logdir_lock.LogdirLock(str(tmp_path), logs.append) as first:
    assert first.held
    with pytest.raises(logdir_lock.LogdirError) as e:
      logdir_lock.LogdirLock(str(tmp_path)).Acquire()
    message = str(e.value)
    assert f'pid {os.getpid()} on host {socket.gethostname()}' in message
    assert 'trainer.lock' in message and '--logdir' in message
  # Released in order: the next holder takes it silently.
  with logdir_lock.LogdirLock(str(tmp_path), logs.append) as again:
    assert again.took_over is None
  assert not logs
  assert (tmp_path / logdir_lock.LOCK_FILE).read_text() == ''


def test_lock_of_a_sigkilled_holder_is_taken_over_with_a_message(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, '-c', _HOLD_AND_SLEEP, str(tmp_path)],
      stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    with pytest.raises(logdir_lock.LogdirError, match=f'pid {holder.pid} '):
      logdir_lock.LogdirLock(str(tmp_path)).Acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
  finally:
    if holder.poll() is None:
      holder.kill()
      holder.wait(timeout=30)
  logs = []
  lock = logdir_lock.LogdirLock(str(tmp_path), logs.append).Acquire()
  try:
    assert lock.took_over['pid'] == holder.pid
    assert logs == [logs[0]] and logs[0].startswith(
        f'Took over the lock of {tmp_path} left by pid {holder.pid}')
    assert 'no longer running' in logs[0]
    text = (tmp_path / logdir_lock.LOCK_FILE).read_text()
    assert text.startswith(f'pid={os.getpid()} host={socket.gethostname()}')
  finally:
    lock.Release()


def test_unusable_logdirs_are_named(tmp_path):
  a_file = tmp_path / 'file'
  a_file.write_text('x')
  with pytest.raises(logdir_lock.LogdirError, match='is a file, not a dir'):
    logdir_lock.PrepareLogdir(str(a_file))
  with pytest.raises(logdir_lock.LogdirError,
                     match=f'lies under {a_file}, which is a file'):
    logdir_lock.PrepareLogdir(str(a_file / 'run'))
  assert logdir_lock.PrepareLogdir(str(tmp_path / 'new' / 'run'))
  assert (tmp_path / 'new' / 'run').is_dir()


def _UnwritableDir(tmp_path):
  if os.geteuid() != 0:
    path = tmp_path / 'read_only'
    path.mkdir()
    path.chmod(0o500)
    return str(path)
  # Root writes through permission bits; sysfs refuses new files even so.
  try:
    with open('/sys/tfpipe_probe', 'a'):
      pass
  except OSError:
    return '/sys'
  os.remove('/sys/tfpipe_probe')
  pytest.skip('no directory here refuses writes')


def test_unwritable_logdir_is_named(tmp_path):
  path = _UnwritableDir(tmp_path)
  with pytest.raises(logdir_lock.LogdirError, match=f'{path} is not writable'):
    logdir_lock.PrepareLogdir(path)
  with pytest.raises(logdir_lock.LogdirError, match='is not writable'):
    logdir_lock.LogdirLock(path).Acquire()


# ---- a lock file planted by someone else -------------------------------------


def _Prepared(logdir):
  logdir_lock.PrepareLogdir(str(logdir))


def _Acquired(logdir):
  logdir_lock.LogdirLock(str(logdir)).Acquire().Release()


@pytest.mark.parametrize('use', [_Prepared, _Acquired],
                         ids=['PrepareLogdir', 'LogdirLock'])
def test_a_planted_link_is_refused_and_its_target_untouched(tmp_path, use):
  # The attack: a link planted in a shared logdir made the trainer
  # truncate the file it points to.
  logdir = tmp_path / 'lm'
  logdir.mkdir()
  target = tmp_path / 'important.txt'
  target.write_text('keep me')
  (logdir / logdir_lock.LOCK_FILE).symlink_to(target)
  with pytest.raises(logdir_lock.LogdirError) as e:
    use(logdir)
  assert str(e.value).startswith(
      f'{logdir / logdir_lock.LOCK_FILE} is a symbolic link (to '
      f"'{target}'); the trainer does not write through links")
  assert '--logdir' in str(e.value)
  assert target.read_text() == 'keep me'


@pytest.mark.parametrize('use', [_Prepared, _Acquired],
                         ids=['PrepareLogdir', 'LogdirLock'])
def test_a_dangling_link_is_refused_without_creating_its_target(tmp_path, use):
  target = tmp_path / 'created_by_the_trainer'
  (tmp_path / logdir_lock.LOCK_FILE).symlink_to(target)
  with pytest.raises(logdir_lock.LogdirError, match='is a symbolic link'):
    use(tmp_path)
  assert not target.exists()


def test_a_lock_file_that_is_not_this_users_regular_file_is_refused(
    tmp_path, monkeypatch):
  lock = tmp_path / logdir_lock.LOCK_FILE
  other = tmp_path / 'other'
  other.write_text('data')
  os.link(other, lock)
  with pytest.raises(logdir_lock.LogdirError,
                     match=f'{lock} has 2 hard links'):
    logdir_lock.LogdirLock(str(tmp_path)).Acquire()
  assert other.read_text() == 'data'
  lock.unlink()
  os.mkfifo(lock)
  with pytest.raises(logdir_lock.LogdirError,
                     match=f'{lock} is not a regular file'):
    logdir_lock.PrepareLogdir(str(tmp_path))
  lock.unlink()
  lock.write_text('pid=1 host=elsewhere since=then\n')
  owner = os.geteuid()
  monkeypatch.setattr(os, 'geteuid', lambda: owner + 1)
  with pytest.raises(logdir_lock.LogdirError,
                     match=f'{lock} belongs to user id {owner}, not to this '
                     f'user \\({owner + 1}\\)'):
    logdir_lock.LogdirLock(str(tmp_path)).Acquire()
  assert lock.read_text() == 'pid=1 host=elsewhere since=then\n'
