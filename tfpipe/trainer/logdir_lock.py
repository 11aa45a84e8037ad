"""One trainer per logdir: the logdir is checked, created and locked.

Two trainers writing one logdir would replace each other's checkpoints and
params.txt, so a training run holds an exclusive lock on
`<logdir>/trainer.lock` for as long as it runs. The lock is an
`flock(LOCK_EX)` on that file: the kernel drops it when the holder's process
ends however it ends, SIGKILL included, so a lock can never outlive a dead
trainer. The file also holds the holder's pid and host, which the refusal
names and which tell a takeover apart from a first start: the holder empties
the file when it lets go, so a non-empty file found unlocked was left by a
trainer that died holding it.

Where flock is not supported (some network file systems), the pid and host
decide alone: a holder on this host whose pid is gone is stale; a holder on
another host is refused, and the message says how to clear it by hand.

The trainer writes (and empties) the lock file, so it must be the file it
looks like. A logdir under /tmp can be prepared by another local user: a
symbolic link named trainer.lock would make the trainer truncate, or create,
whatever file the link points to. So the file is opened without following a
link (O_NOFOLLOW), and used only if it is a regular file owned by this user
with no other hard link; anything else is refused, naming the path.
"""

import errno
import fcntl
import os
import socket
import stat
import time

LOCK_FILE = 'trainer.lock'


class LogdirError(Exception):
  """The logdir cannot be used: not a directory, not writable, or in use."""


def PrepareLogdir(logdir):
  """Creates `logdir` (and parents), or a LogdirError saying what is wrong.

  Returns:
    The logdir, unchanged.
  """
  if '://' in logdir:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    try:
      tf.io.gfile.makedirs(logdir)
    except tf.errors.OpError as e:
      raise LogdirError(f'--logdir={logdir}: cannot create it ({e.message}).'
                        ) from None
    return logdir
  if os.path.exists(logdir) and not os.path.isdir(logdir):
    raise LogdirError(f'--logdir={logdir} is a file, not a directory; give '
                      'the path of a directory (it is created if missing).')
  try:
    os.makedirs(logdir, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise LogdirError(
        f'--logdir={logdir} lies under {_FirstFileAbove(logdir)}, which is a '
        'file, not a directory; give another --logdir.') from None
  except OSError as e:
    raise LogdirError(f'--logdir={logdir}: cannot create it ({e.strerror}); '
                      'give a --logdir you can write to.') from None
  os.close(OpenLockFile(logdir))
  return logdir


def OpenLockFile(logdir):
  """A read-write descriptor of `<logdir>/trainer.lock`, created if missing.

  Never follows a symbolic link, and refuses a file that is not a regular
  file of this user's with a single link, so that writing it cannot touch
  any other file.

  Raises:
    LogdirError: naming the path and what is wrong with it.
  """
  path = os.path.join(logdir, LOCK_FILE)
  flags = (os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK |
           os.O_CLOEXEC)
  try:
    fd = os.open(path, flags, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise LogdirError(
          f'{path} is a symbolic link (to {_LinkTarget(path)}); the trainer '
          'does not write through links, which could truncate another file. '
          'Remove it if you made it, or give another --logdir.') from None
    raise LogdirError(f'--logdir={logdir} is not writable: cannot create '
                      f'{path} ({e.strerror}); give a --logdir you can write '
                      'to.') from None
  try:
    problem = _LockFileProblem(os.fstat(fd))
  except BaseException:
    os.close(fd)
    raise
  if problem:
    os.close(fd)
    raise LogdirError(f'{path} {problem}, so the trainer does not use it as '
                      'its lock. Remove it if you made it, or give another '
                      '--logdir.')
  return fd


def _LinkTarget(path):
  try:
    return repr(os.readlink(path))
  except OSError:
    return 'an unreadable target'


def _LockFileProblem(st):
  """What makes an opened file unfit to be the lock file, or None."""
  if not stat.S_ISREG(st.st_mode):
    return 'is not a regular file'
  if st.st_uid != os.geteuid():
    return (f'belongs to user id {st.st_uid}, not to this user '
            f'({os.geteuid()})')
  if st.st_nlink > 1:
    return f'has {st.st_nlink} hard links (it is another file too)'
  return None


def _FirstFileAbove(path):
  path = os.path.abspath(path)
  while path != os.path.dirname(path):
    if os.path.exists(path) and not os.path.isdir(path):
      return path
    path = os.path.dirname(path)
  return 'a file'


def _ReadHolder(fd):
  """{'pid': int, 'host': str, 'since': str} from the lock file, or None."""
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 4096).decode('utf-8', 'replace').strip()
  if not text:
    return None
  fields = dict(part.split('=', 1) for part in text.split() if '=' in part)
  try:
    return {'pid': int(fields.get('pid', '')), 'host': fields.get('host', '?'),
            'since': fields.get('since', '?')}
  except ValueError:
    return {'pid': -1, 'host': '?', 'since': '?'}


def _PidAlive(pid):
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _Describe(holder):
  return (f'pid {holder["pid"]} on host {holder["host"]} '
          f'(since {holder["since"]})')


class LogdirLock:
  """An exclusive, crash-safe lock on a logdir; a context manager.

  Attributes:
    path: the lock file.
    took_over: the stale holder that was replaced (dict), or None.
  """

  def __init__(self, logdir, log=print):
    self.logdir = logdir
    self.path = os.path.join(logdir, LOCK_FILE)
    self._log = log
    self._fd = None
    self.took_over = None

  @property
  def held(self):
    return self._fd is not None

  def Acquire(self):
    """Takes the lock, or raises LogdirError naming the holder."""
    if '://' in self.logdir:
      self._log(f'Note: {self.logdir} is not a local path; it is not locked '
                'against a second trainer.')
      return self
    fd = OpenLockFile(self.logdir)
    try:
      holder = self._Lock(fd)
      if holder is not None:
        self.took_over = holder
        gone = ('is no longer running' if holder['host'] ==
                socket.gethostname() else 'no longer holds it')
        self._log(f'Took over the lock of {self.logdir} left by '
                  f'{_Describe(holder)}, which {gone}.')
      os.ftruncate(fd, 0)
      os.lseek(fd, 0, os.SEEK_SET)
      os.write(fd, (f'pid={os.getpid()} host={socket.gethostname()} '
                    f'since={time.strftime("%Y-%m-%dT%H:%M:%S")}\n').encode())
      os.fsync(fd)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd
    return self

  def _Lock(self, fd):
    """Locks `fd`; returns the stale holder found in the file, or None."""
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _ReadHolder(fd) or {'pid': '?', 'host': '?', 'since': '?'}
      raise LogdirError(
          f'--logdir={self.logdir} is in use by another trainer: '
          f'{_Describe(holder)} holds {self.path}. Stop it first, or give '
          'another --logdir.') from None
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        raise
      return self._CheckHolderByPid(fd)
    return _ReadHolder(fd)

  def _CheckHolderByPid(self, fd):
    """Without flock: a holder is stale only if its pid is gone on this host."""
    holder = _ReadHolder(fd)
    if holder is None:
      return None
    if holder['host'] != socket.gethostname():
      raise LogdirError(
          f'--logdir={self.logdir} is in use by {_Describe(holder)} (this '
          'file system cannot lock, so whether it still runs is unknown). '
          f'If it has stopped, delete {self.path}; otherwise give another '
          '--logdir.')
    if _PidAlive(holder['pid']) and holder['pid'] != os.getpid():
      raise LogdirError(
          f'--logdir={self.logdir} is in use by another trainer: '
          f'{_Describe(holder)} holds {self.path}. Stop it first, or give '
          'another --logdir.')
    return holder

  def Release(self):
    """Empties the lock file (an orderly exit) and lets go of the lock."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
    finally:
      os.close(fd)  # Closing the last descriptor drops the flock.

  def __enter__(self):
    return self.Acquire()

  def __exit__(self, *unused_exc):
    self.Release()
