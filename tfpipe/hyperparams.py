"""Lingvo-style hyper-parameters: the data from which every tfpipe object is built.

A `Params` is an ordered tree of named, documented values. Layers, models and
experiments describe themselves as params, so a whole configuration can be
printed (`ToText`), diffed, overridden from the command line (`FromText`) and
then turned into objects (`InstantiableParams.Instantiate`).

Why not plain dicts: a typo in a key must fail loudly and say what was meant,
and every knob must carry a sentence saying what it does.
"""

import ast
import copy
import difflib
import enum
import importlib
import re


_PARAM_NAME = re.compile(r'[a-z][a-z0-9_]*')
_CLS_DOC = 'The class these params build.'


def _ClosestNames(name, candidates, n=3):
  return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)


def _UnknownNameMessage(name, candidates, what='param'):
  msg = f'Unknown {what} {name!r}.'
  # Match the last component only: 'a.b.nmae' suggests 'a.b.name'.
  prefix, _, leaf = name.rpartition('.')
  close = _ClosestNames(leaf, candidates)
  if close:
    msg += ' Did you mean ' + ' or '.join(
        repr(f'{prefix}.{c}' if prefix else c) for c in close) + '?'
  elif candidates:
    msg += ' Defined names: ' + ', '.join(sorted(candidates)) + '.'
  return msg


class _Param:
  """One named value with its documentation."""

  def __init__(self, name, default, doc):
    self.name = name
    self.value = default
    self.doc = doc

  def __deepcopy__(self, memo):
    return _Param(self.name, _CopyValue(self.value), self.doc)


def _CopyValue(value):
  """Copies the data of a params tree and shares every other object.

  Nested Params and plain containers are copied so a copied params can be
  edited freely. Classes, functions, Keras layers, tensors and other objects
  are shared, never cloned: a params that names an existing layer must keep
  naming that very layer (and its variables).
  """
  if isinstance(value, Params):
    return value.Copy()
  if isinstance(value, dict):
    return type(value)((k, _CopyValue(v)) for k, v in value.items())
  if isinstance(value, (list, tuple)) and not hasattr(value, '_fields'):
    return type(value)(_CopyValue(v) for v in value)
  return value


class Params:
  """An ordered, documented, freezable set of hyper-parameters."""

  def __init__(self):
    self.__dict__['_params'] = {}
    self.__dict__['_immutable'] = False

  # ---- definition -------------------------------------------------------

  def Define(self, name, default_value, description):
    """Adds `name` with its default and a one-sentence description."""
    if self._immutable:
      raise TypeError(f'This Params is frozen; cannot Define {name!r}.')
    if not isinstance(name, str) or not _PARAM_NAME.fullmatch(name):
      raise ValueError(
          f'Param names are lower_case_with_underscores; received {name!r}.')
    if name in self._params:
      raise AttributeError(f'Param {name!r} is already defined.')
    self._params[name] = _Param(name, default_value, description)

  def Delete(self, *names):
    """Removes params; a dotted name reaches into nested params."""
    if self._immutable:
      raise TypeError('This Params is frozen; cannot Delete.')
    for name in names:
      parent, key = self._ResolveParent(name)
      if key not in parent._params:  # pylint: disable=protected-access
        raise AttributeError(_UnknownNameMessage(name, parent._params))  # pylint: disable=protected-access
      del parent._params[key]  # pylint: disable=protected-access
    return self

  def Freeze(self):
    """Makes this params (and nested params) read-only."""
    self.__dict__['_immutable'] = True
    for p in self._params.values():
      if isinstance(p.value, Params):
        p.value.Freeze()
      elif _IsParamsList(p.value):
        for item in p.value:
          item.Freeze()
    return self

  @property
  def is_frozen(self):
    return self._immutable

  # ---- access -----------------------------------------------------------

  def __getattr__(self, name):
    if name.startswith('__'):
      raise AttributeError(name)
    params = self.__dict__['_params']
    if name not in params:
      if name == 'cls' and '_cls' in self.__dict__:
        return self.__dict__['_cls']
      raise AttributeError(_UnknownNameMessage(name, params))
    return params[name].value

  def __setattr__(self, name, value):
    if self._immutable:
      raise TypeError(f'This Params is frozen; cannot set {name!r}.')
    if name not in self._params:
      if name == 'cls' and '_cls' in self.__dict__:
        self.__dict__['_cls'] = value
        return
      raise AttributeError(_UnknownNameMessage(name, self._params))
    self._params[name].value = value

  def __contains__(self, name):
    try:
      parent, key = self._ResolveParent(name)
    except AttributeError:
      return False
    return key in parent._params  # pylint: disable=protected-access

  def __dir__(self):
    return sorted(set(super().__dir__()) | set(self._params))

  def __len__(self):
    return len(self._params)

  def __eq__(self, other):
    if not isinstance(other, Params):
      return False
    return (list(self._params) == list(other._params) and all(
        _ValuesEqual(self._params[k].value, other._params[k].value)
        for k in self._params))

  def __ne__(self, other):
    return not self == other

  __hash__ = None

  def _ResolveParent(self, dotted_name):
    parts = dotted_name.split('.')
    node = self
    for i, part in enumerate(parts[:-1]):
      if part not in node._params:  # pylint: disable=protected-access
        raise AttributeError(
            _UnknownNameMessage('.'.join(parts[:i + 1]), node._params))  # pylint: disable=protected-access
      node = node._params[part].value  # pylint: disable=protected-access
      if not isinstance(node, Params):
        raise AttributeError(
            f'{".".join(parts[:i + 1])!r} is not a nested Params; cannot '
            f'reach {dotted_name!r}.')
    return node, parts[-1]

  def Get(self, name):
    """Reads a param; a dotted name reaches into nested params."""
    parent, key = self._ResolveParent(name)
    try:
      return getattr(parent, key)
    except AttributeError:  # Name the full dotted key, not just its leaf.
      raise AttributeError(_UnknownNameMessage(name, parent._params)) from None  # pylint: disable=protected-access

  def Set(self, **kwargs):
    """Sets params and returns self; keys may be dotted, e.g. `Set(**{'a.b': 1})`."""
    for name, value in kwargs.items():
      parent, key = self._ResolveParent(name)
      try:
        setattr(parent, key, value)
      except AttributeError:  # Name the full dotted key, not just its leaf.
        raise AttributeError(_UnknownNameMessage(name, parent._params)) from None  # pylint: disable=protected-access
    return self

  def GetDoc(self, name):
    parent, key = self._ResolveParent(name)
    if key not in parent._params:  # pylint: disable=protected-access
      raise AttributeError(_UnknownNameMessage(name, parent._params))  # pylint: disable=protected-access
    return parent._params[key].doc  # pylint: disable=protected-access

  def IterParams(self):
    """Yields (name, value) pairs in definition order."""
    for name, p in self._params.items():
      yield name, p.value

  def Copy(self):
    """A deep, unfrozen copy."""
    return self._CopyTo(type(self).__new__(type(self)))

  def _CopyTo(self, result):
    # Nested params are copied by Copy (unfrozen); see _CopyValue.
    result.__dict__['_params'] = {
        name: _Param(name, _CopyValue(p.value), p.doc)
        for name, p in self._params.items()}
    result.__dict__['_immutable'] = False
    for name, value in self.__dict__.items():
      if name not in ('_params', '_immutable'):
        result.__dict__[name] = copy.deepcopy(value)
    return result

  def __deepcopy__(self, memo):
    return self.Copy()

  # ---- text ---------------------------------------------------------------

  def _Flatten(self, prefix=''):
    """Yields (dotted_name, value) for every leaf."""
    for key, value, _ in self.Leaves(prefix):
      yield key, value

  def Leaves(self, prefix=''):
    """Yields (dotted_name, value, doc) for every leaf, in definition order.

    What `ToText` prints, with each param's one-sentence description; the
    `cls` line of a nested instantiable params is documented as its class.
    """
    for name, param in self._params.items():
      key, value = prefix + name, param.value
      if isinstance(value, Params):
        if value._HasTargetClassLine():  # pylint: disable=protected-access
          yield key + '.cls', value.__dict__['_cls'], _CLS_DOC
        yield from value.Leaves(key + '.')
      elif _IsParamsList(value):
        for i, item in enumerate(value):
          if item._HasTargetClassLine():  # pylint: disable=protected-access
            yield f'{key}[{i}].cls', item.__dict__['_cls'], _CLS_DOC
          yield from item.Leaves(f'{key}[{i}].')
        if not value:
          yield key, [], param.doc
      else:
        yield key, value, param.doc

  def _HasTargetClassLine(self):
    return '_cls' in self.__dict__ and 'cls' not in self._params

  def ToText(self, docs=False):
    """One `dotted.name : value` line per leaf, sorted: readable and diffable.

    With docs=True each line follows a `# <description>` line (the param's
    Define sentence), which FromText skips.
    """
    lines = []
    for key, value, doc in sorted(self.Leaves(), key=lambda leaf: leaf[0]):
      if docs and doc:
        lines.append(f'# {doc}\n')
      lines.append(f'{key} : {_ValueToText(value)}\n')
    return ''.join(lines)

  def FromText(self, text):
    """Sets params from `ToText` output or `a.b: 1; c: 'x'` overrides.

    Values are parsed as Python literals where they can be; otherwise they
    are kept as strings. Each value is checked against the current type.
    """
    # Whole-line comments (ToText(docs=True)) may hold a ';' of their own.
    text = '\n'.join(line for line in text.splitlines()
                     if not line.lstrip().startswith('#'))
    for line in _SplitStatements(text):
      line = line.strip()
      if not line or line.startswith('#'):
        continue
      if ':' not in line:
        raise ValueError(f'Cannot parse params line {line!r}; expected '
                         '"name : value".')
      key, value_text = line.split(':', 1)
      key = key.strip()
      if re.search(r'\[\d+\]', key):
        node, leaf = self._ResolveIndexed(key)
      else:
        node, leaf = self._ResolveParent(key)
      if leaf == 'cls' and node._HasTargetClassLine():  # pylint: disable=protected-access
        old = node.__dict__['_cls']
        if _ValueToText(old) != value_text.strip():
          raise ValueError(f'{key}: FromText cannot change a class; it is '
                           f'{_ValueToText(old)}.')
        continue
      if leaf not in node._params:  # pylint: disable=protected-access
        raise AttributeError(_UnknownNameMessage(key, node._params))  # pylint: disable=protected-access
      old = node._params[leaf].value  # pylint: disable=protected-access
      setattr(node, leaf, _TextToValue(key, value_text.strip(), old))
    return self

  def _ResolveIndexed(self, dotted_name):
    node = self
    parts = dotted_name.split('.')
    for part in parts[:-1]:
      m = re.match(r'^([a-z0-9_]+)(?:\[(\d+)\])?$', part)
      if not m:
        raise AttributeError(f'Cannot parse params key {dotted_name!r}.')
      node = node.Get(m.group(1))
      if m.group(2) is not None:
        node = node[int(m.group(2))]
    return node, parts[-1]

  def __str__(self):
    return self.ToText()

  def __repr__(self):
    return f'{type(self).__name__}(\n{self.ToText()})'

  def TextDiff(self, other):
    """A readable diff: `-` lines are only in self, `+` only in other."""
    mine = dict(self._Flatten())
    theirs = dict(other._Flatten())  # pylint: disable=protected-access
    lines = []
    for key in sorted(set(mine) | set(theirs)):
      if key in mine and key not in theirs:
        lines.append(f'- {key} : {_ValueToText(mine[key])}')
      elif key in theirs and key not in mine:
        lines.append(f'+ {key} : {_ValueToText(theirs[key])}')
      elif not _ValuesEqual(mine[key], theirs[key]):
        lines.append(f'- {key} : {_ValueToText(mine[key])}')
        lines.append(f'+ {key} : {_ValueToText(theirs[key])}')
    return '\n'.join(lines) + ('\n' if lines else '')


class InstantiableParams(Params):
  """Params that know the class they configure."""

  def __init__(self, cls=None):
    super().__init__()
    self.__dict__['_cls'] = cls

  @property
  def target_cls(self):
    """The class that `Instantiate` builds (also `p.cls` unless redefined)."""
    return self.__dict__['_cls']

  def Instantiate(self, **kwargs):
    """Builds `cls(self)`; extra keyword arguments go to the constructor."""
    if self.target_cls is None:
      raise ValueError('This InstantiableParams has no cls to instantiate.')
    return self.target_cls(self, **kwargs)

  def __eq__(self, other):
    return (isinstance(other, InstantiableParams) and
            self.target_cls is other.target_cls and super().__eq__(other))

  __hash__ = None


def _SplitStatements(text):
  """Splits FromText input on newlines and on `;` outside string literals."""
  out, cur, quote, i = [], [], None, 0
  while i < len(text):
    ch = text[i]
    if quote and ch != '\n':  # A newline always ends a statement.
      cur.append(ch)
      if ch == '\\' and i + 1 < len(text):
        cur.append(text[i + 1])
        i += 1
      elif ch == quote:
        quote = None
    elif ch in '\'"':
      quote = ch
      cur.append(ch)
    elif ch in '\n;':
      out.append(''.join(cur))
      cur, quote = [], None
    else:
      cur.append(ch)
    i += 1
  out.append(''.join(cur))
  return out


def _IsParamsList(value):
  return (isinstance(value, (list, tuple)) and value and
          all(isinstance(v, Params) for v in value))


def _ValuesEqual(a, b):
  if isinstance(a, Params) or isinstance(b, Params):
    return isinstance(a, Params) and isinstance(b, Params) and a == b
  try:
    eq = a == b
    if isinstance(eq, bool):
      return eq
    return bool(all(eq)) if hasattr(eq, '__iter__') else bool(eq)
  except Exception:  # pylint: disable=broad-except
    return a is b


def FormatValue(value):
  """A value as `ToText` writes it: a literal, or a class by its import path."""
  return _ValueToText(value)


def _ValueToText(value):
  if isinstance(value, type) or callable(value) and hasattr(value, '__qualname__'):
    return f'{value.__module__}.{value.__qualname__}'
  if isinstance(value, enum.Enum):
    return f'{type(value).__module__}.{type(value).__qualname__}.{value.name}'
  return repr(value)


def _TextToValue(key, text, old):
  """Parses `text` into a value of the same kind as `old`."""
  if isinstance(old, type) or (callable(old) and hasattr(old, '__qualname__')
                               and not isinstance(old, Params)):
    return _ImportSymbol(key, text)
  if isinstance(old, enum.Enum):
    name = text.rsplit('.', 1)[-1]
    return type(old)[name]
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if re.match(r'^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$', text) and old is None:
      try:
        return _ImportSymbol(key, text)
      except ValueError:
        pass
    value = text
  if old is None or value is None:
    return value
  if isinstance(old, bool) and not isinstance(value, bool):
    raise ValueError(f'{key}: expected a bool (True/False), received {text!r}.')
  if isinstance(old, (int, float)) and not isinstance(old, bool):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
      raise ValueError(f'{key}: expected a number, received {text!r}.')
    return type(old)(value) if isinstance(old, float) else value
  # A name-or-list param (e.g. a pipeline's balance: 'flops' or [2, 4])
  # takes a list literal as a list; other literals stay the text they were.
  if isinstance(old, str) and not isinstance(value, (str, list, tuple)):
    return text
  if isinstance(old, (list, tuple)) and isinstance(value, (list, tuple)):
    return type(old)(value)
  return value


def _ImportSymbol(key, text):
  module_name, _, attr = text.rpartition('.')
  while module_name:
    try:
      module = importlib.import_module(module_name)
      obj = module
      for part in attr.split('.'):
        obj = getattr(obj, part)
      return obj
    except (ImportError, AttributeError):
      module_name, _, head = module_name.rpartition('.')
      attr = head + '.' + attr
  raise ValueError(f'{key}: cannot import {text!r}.')
