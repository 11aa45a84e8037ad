"""Tests for tfpipe.hyperparams."""

import enum

import pytest

from tfpipe import hyperparams


class Color(enum.Enum):
  RED = 1
  BLUE = 2


class Target:
  """A class configured by params: Instantiate calls Target(params, **kw)."""

  def __init__(self, params, extra=None):
    self.params = params
    self.extra = extra


class OtherTarget(Target):
  pass


def _Nested():
  p = hyperparams.Params()
  p.Define('name', 'top', 'Name.')
  p.Define('dim', 4, 'Width.')
  sub = hyperparams.Params()
  sub.Define('rate', 0.5, 'Rate.')
  sub.Define('deep', hyperparams.Params(), 'Deeper.')
  sub.deep.Define('flag', False, 'A flag.')
  p.Define('sub', sub, 'A nested params.')
  return p


def _WithList():
  p = hyperparams.Params()
  items = []
  for i in range(2):
    item = hyperparams.InstantiableParams(Target)
    item.Define('name', f'item{i}', 'Name.')
    item.Define('units', i + 1, 'Units.')
    items.append(item)
  p.Define('layers', items, 'A list of params.')
  return p


# ---- Define / get / set -----------------------------------------------------


def test_define_get_set():
  p = hyperparams.Params()
  p.Define('lr', 0.1, 'Learning rate.')
  assert p.lr == 0.1
  p.lr = 0.2
  assert p.lr == 0.2
  assert 'lr' in p
  assert 'nope' not in p
  assert len(p) == 1
  assert p.GetDoc('lr') == 'Learning rate.'


def test_define_twice_raises():
  p = hyperparams.Params()
  p.Define('a', 1, '')
  with pytest.raises(AttributeError, match='already defined'):
    p.Define('a', 2, '')


@pytest.mark.parametrize('bad', ['CamelCase', '1abc', 'with-dash', '', 3])
def test_define_rejects_bad_names(bad):
  with pytest.raises(ValueError):
    hyperparams.Params().Define(bad, 1, '')


def test_set_returns_self_and_reaches_nested_with_dotted_keys():
  p = _Nested()
  result = p.Set(dim=8, **{'sub.rate': 0.25, 'sub.deep.flag': True})
  assert result is p
  assert p.dim == 8
  assert p.sub.rate == 0.25
  assert p.sub.deep.flag is True


def test_get_dotted():
  p = _Nested()
  assert p.Get('name') == 'top'
  assert p.Get('sub.rate') == 0.5
  assert p.Get('sub.deep.flag') is False
  assert 'sub.deep.flag' in p
  assert 'sub.deep.nope' not in p


def test_get_through_non_params_raises():
  p = _Nested()
  with pytest.raises(AttributeError, match='not a nested Params'):
    p.Get('dim.x')


# ---- Unknown names -----------------------------------------------------------


def test_unknown_get_names_bad_name_and_suggests_closest():
  p = _Nested()
  with pytest.raises(AttributeError) as e:
    _ = p.dmi
  assert "'dmi'" in str(e.value)
  assert "Did you mean 'dim'" in str(e.value)


def test_unknown_set_names_bad_name_and_suggests_closest():
  p = _Nested()
  with pytest.raises(AttributeError) as e:
    p.nmae = 'x'
  assert "'nmae'" in str(e.value)
  assert "'name'" in str(e.value)
  with pytest.raises(AttributeError) as e:
    p.Set(**{'sub.deep.flga': True})
  assert "'sub.deep.flga'" in str(e.value)
  assert "Did you mean 'sub.deep.flag'" in str(e.value)


def test_unknown_dotted_get_names_full_key():
  p = _Nested()
  with pytest.raises(AttributeError) as e:
    p.Get('sub.deep.flga')
  assert "'sub.deep.flga'" in str(e.value)
  assert "Did you mean 'sub.deep.flag'" in str(e.value)


def test_unknown_intermediate_name_suggests_closest():
  p = _Nested()
  with pytest.raises(AttributeError) as e:
    p.Set(**{'sbu.rate': 1.0})
  assert "'sbu'" in str(e.value)
  assert "'sub'" in str(e.value)


def test_unknown_name_without_close_match_lists_defined_names():
  p = _Nested()
  with pytest.raises(AttributeError) as e:
    _ = p.zzzzzz
  assert 'zzzzzz' in str(e.value)
  assert 'Defined names: dim, name, sub' in str(e.value)


def test_unknown_name_in_from_text_suggests_dotted_closest():
  p = _Nested()
  with pytest.raises(AttributeError) as e:
    p.FromText('sub.deep.flga : True')
  assert "'sub.deep.flga'" in str(e.value)
  assert "Did you mean 'sub.deep.flag'" in str(e.value)
  with pytest.raises(AttributeError) as e:
    p.FromText('sbu.rate : 1.0')
  assert "'sub'" in str(e.value)


def test_dunder_lookup_is_plain_attribute_error():
  p = hyperparams.Params()
  assert not hasattr(p, '__array__')


# ---- Copy / Delete / Freeze --------------------------------------------------


def test_copy_is_deep():
  p = _Nested()
  p.Define('values', [1, 2], 'A list.')
  q = p.Copy()
  assert q == p
  q.sub.deep.flag = True
  q.values.append(3)
  q.name = 'copy'
  assert p.sub.deep.flag is False
  assert p.values == [1, 2]
  assert p.name == 'top'
  assert q != p


def test_copy_of_params_list_is_deep():
  p = _WithList()
  q = p.Copy()
  q.layers[0].units = 100
  assert p.layers[0].units == 1
  assert q.layers[0].target_cls is Target


def test_copy_shares_classes_and_keeps_type():
  p = hyperparams.InstantiableParams(Target)
  p.Define('fn', len, 'A function.')
  q = p.Copy()
  assert type(q) is hyperparams.InstantiableParams
  assert q.fn is len
  assert q.target_cls is Target
  assert q == p


def test_delete():
  p = _Nested()
  assert p.Delete('dim', 'sub.deep.flag') is p
  assert 'dim' not in p
  assert 'sub.deep.flag' not in p
  assert len(p.sub.deep) == 0
  with pytest.raises(AttributeError, match='dim'):
    p.Delete('dim')


def test_freeze():
  p = _Nested()
  assert p.Freeze() is p
  assert p.is_frozen
  with pytest.raises(TypeError):
    p.dim = 3
  with pytest.raises(TypeError):
    p.sub.deep.flag = True
  with pytest.raises(TypeError):
    p.Set(**{'sub.rate': 1.0})
  with pytest.raises(TypeError):
    p.Define('new', 1, '')
  with pytest.raises(TypeError):
    p.Delete('dim')
  with pytest.raises(TypeError):
    p.FromText('dim : 5')
  assert p.dim == 4  # Reading still works.


def test_freeze_reaches_params_in_lists():
  p = _WithList().Freeze()
  with pytest.raises(TypeError):
    p.layers[1].units = 7


def test_copy_of_frozen_is_unfrozen():
  p = _Nested().Freeze()
  q = p.Copy()
  assert not q.is_frozen
  q.sub.deep.flag = True
  assert q.sub.deep.flag is True
  assert p.is_frozen


# ---- Iteration and equality ---------------------------------------------------


def test_iter_params_in_definition_order():
  p = hyperparams.Params()
  for name in ['zeta', 'alpha', 'mid']:
    p.Define(name, name.upper(), '')
  assert list(p.IterParams()) == [('zeta', 'ZETA'), ('alpha', 'ALPHA'),
                                  ('mid', 'MID')]


def test_equality():
  assert _Nested() == _Nested()
  p = _Nested()
  p.sub.rate = 0.75
  assert p != _Nested()
  assert _Nested() != {'name': 'top'}
  a = hyperparams.InstantiableParams(Target)
  b = hyperparams.InstantiableParams(OtherTarget)
  assert a != b
  with pytest.raises(TypeError):
    hash(a)


def test_dir_lists_params():
  assert {'dim', 'name', 'sub'} <= set(dir(_Nested()))


# ---- Text ---------------------------------------------------------------------


def _AllKinds():
  p = hyperparams.Params()
  p.Define('b', True, '')
  p.Define('f', 0.5, '')
  p.Define('i', 3, '')
  p.Define('s', 'hello', '')
  p.Define('s2', "it's a \"quote\"; and: colon", '')
  p.Define('n', None, '')
  p.Define('l', [1, 'two', 3.0], '')
  p.Define('t', (1, 2), '')
  p.Define('d', {'k': 1}, '')
  p.Define('empty', [], '')
  p.Define('color', Color.RED, '')
  p.Define('klass', Target, '')
  p.Define('fn', len, '')
  return p


def test_to_text_is_sorted_dotted_lines():
  text = _Nested().ToText()
  assert text == ("dim : 4\n"
                  "name : 'top'\n"
                  "sub.deep.flag : False\n"
                  "sub.rate : 0.5\n")
  assert str(_Nested()) == text
  assert 'Params(' in repr(_Nested())


def test_text_round_trip_nested():
  p = _Nested()
  p.Set(name='changed', dim=16, **{'sub.rate': 0.125, 'sub.deep.flag': True})
  q = _Nested().FromText(p.ToText())
  assert q == p
  assert q.ToText() == p.ToText()


def test_to_text_with_docs_puts_each_sentence_above_its_line():
  p = _Nested()
  p.Define('clip', 1.0, 'Clip to this norm; 0 disables clipping.')
  text = p.ToText(docs=True)
  assert '# Clip to this norm; 0 disables clipping.\nclip : 1.0\n' in text
  lines = text.splitlines()
  assert [l for l in lines if not l.startswith('#')] == (
      p.ToText().splitlines())
  leaves = {key: doc for key, _, doc in p.Leaves()}
  assert leaves['sub.rate'] == p.GetDoc('sub.rate')
  # Comments, ';' in them included, are skipped when read back.
  p.Set(clip=0.5, **{'sub.rate': 0.25})
  q = _Nested()
  q.Define('clip', 1.0, 'Clip to this norm; 0 disables clipping.')
  assert q.FromText(p.ToText(docs=True)) == p


def test_text_round_trip_all_value_kinds():
  p = _AllKinds()
  text = p.ToText()
  assert f'klass : {__name__}.Target\n' in text
  assert 'fn : builtins.len\n' in text
  assert f'color : {__name__}.Color.RED\n' in text
  # Typed defaults: start from different values of the same kinds.
  q = _AllKinds().Set(b=False, f=9.0, i=0, s='', s2='', l=[], t=(), d={},
                      color=Color.BLUE, klass=OtherTarget, fn=sorted)
  q.FromText(text)
  assert q == p
  assert q.klass is Target
  assert q.fn is len
  assert q.color is Color.RED
  assert isinstance(q.t, tuple)
  assert q.s2 == "it's a \"quote\"; and: colon"


def test_from_text_fills_none_defaults():
  p = hyperparams.Params()
  p.Define('x', None, '')
  p.Define('y', None, '')
  p.Define('z', None, '')
  p.FromText(f'x : 3\ny : plain words\nz : {__name__}.Target')
  assert p.x == 3
  assert p.y == 'plain words'
  assert p.z is Target


def test_from_text_override_string():
  p = _Nested()
  p.FromText("sub.rate: 1; name: 'x'; sub.deep.flag : True")
  assert p.sub.rate == 1.0 and isinstance(p.sub.rate, float)
  assert p.name == 'x'
  assert p.sub.deep.flag is True


def test_from_text_keeps_semicolons_inside_strings():
  p = _Nested()
  p.FromText("name : 'a;b' ; dim : 2")
  assert p.name == 'a;b'
  assert p.dim == 2


def test_from_text_ignores_comments_and_blank_lines():
  p = _Nested()
  p.FromText('\n# a comment\n\n  dim : 7  \n')
  assert p.dim == 7


def test_from_text_unquoted_string():
  p = _Nested()
  p.FromText('name : hello world')
  assert p.name == 'hello world'


def test_from_text_type_checks():
  p = _Nested()
  with pytest.raises(ValueError, match='bool'):
    p.FromText('sub.deep.flag : 1')
  with pytest.raises(ValueError, match='number'):
    p.FromText('dim : many')
  with pytest.raises(ValueError, match='number'):
    p.FromText('dim : True')
  with pytest.raises(ValueError, match='name : value'):
    p.FromText('just words')
  p.FromText('dim : None')
  assert p.dim is None


def test_from_text_bad_class_raises():
  p = hyperparams.Params()
  p.Define('klass', Target, '')
  with pytest.raises(ValueError, match='cannot import'):
    p.FromText('klass : no_such_module_xyz.Thing')


def test_params_list_text_and_round_trip():
  p = _WithList()
  p.layers[1].units = 9
  text = p.ToText()
  assert text == (f'layers[0].cls : {__name__}.Target\n'
                  "layers[0].name : 'item0'\n"
                  'layers[0].units : 1\n'
                  f'layers[1].cls : {__name__}.Target\n'
                  "layers[1].name : 'item1'\n"
                  'layers[1].units : 9\n')
  q = _WithList().FromText(text)
  assert q == p
  q.FromText("layers[0].name : 'renamed'")
  assert q.layers[0].name == 'renamed'
  with pytest.raises(AttributeError, match='unts'):
    q.FromText('layers[1].unts : 3')


def test_cls_lines_for_nested_instantiable_params():
  p = hyperparams.Params()
  p.Define('child', hyperparams.InstantiableParams(Target), '')
  p.child.Define('units', 2, '')
  text = p.ToText()
  assert f'child.cls : {__name__}.Target\n' in text
  # The same class is accepted; a different one is refused.
  p.FromText(text)
  with pytest.raises(ValueError, match='cannot change a class'):
    p.FromText(f'child.cls : {__name__}.OtherTarget')


def test_text_diff():
  a = _Nested()
  b = _Nested()
  b.Set(dim=5, **{'sub.deep.flag': True})
  b.Delete('name')
  b.Define('extra', 'e', '')
  assert a.TextDiff(b) == ("- dim : 4\n"
                           "+ dim : 5\n"
                           "+ extra : 'e'\n"
                           "- name : 'top'\n"
                           "- sub.deep.flag : False\n"
                           "+ sub.deep.flag : True\n")
  assert a.TextDiff(_Nested()) == ''


# ---- InstantiableParams ---------------------------------------------------------


def test_instantiate():
  p = hyperparams.InstantiableParams(Target)
  p.Define('units', 3, '')
  obj = p.Instantiate(extra='kw')
  assert isinstance(obj, Target)
  assert obj.params is p
  assert obj.extra == 'kw'
  assert p.cls is Target
  assert p.target_cls is Target


def test_instantiate_without_class_raises():
  with pytest.raises(ValueError, match='no cls'):
    hyperparams.InstantiableParams().Instantiate()


def test_cls_is_settable_when_not_defined():
  p = hyperparams.InstantiableParams(Target)
  p.cls = OtherTarget
  assert p.target_cls is OtherTarget
  assert isinstance(p.Instantiate(), OtherTarget)


def test_plain_params_has_no_cls():
  with pytest.raises(AttributeError):
    _ = hyperparams.Params().cls


def test_defined_cls_param_shadows_target_class():
  """KerasLayer-style: the params has its own 'cls' (the wrapped class)."""
  p = hyperparams.InstantiableParams(Target)
  p.Define('cls', None, 'The Keras layer class to wrap.')
  assert p.cls is None
  p.cls = OtherTarget
  assert p.cls is OtherTarget
  assert p.target_cls is Target
  obj = p.Instantiate()
  assert type(obj) is Target
  assert obj.params.cls is OtherTarget
  # Text shows the defined param, not a class line for the target.
  assert p.ToText() == f'cls : {__name__}.OtherTarget\n'
  q = hyperparams.InstantiableParams(Target)
  q.Define('cls', None, '')
  q.FromText(p.ToText())
  assert q.cls is OtherTarget
  assert q == p
  # Copy keeps both.
  c = p.Copy()
  assert c.cls is OtherTarget and c.target_cls is Target
  assert type(c.Instantiate()) is Target


def test_from_text_list_for_a_string_param_stays_a_list():
  # A pipeline's balance is a method name or a list of layer counts; both
  # must come through --model_params_override and a params.txt round trip.
  p = hyperparams.Params()
  p.Define('balance', 'flops', 'A method name or a list of layer counts.')
  p.FromText('balance : [2, 4]')
  assert p.balance == [2, 4]
  q = hyperparams.Params()
  q.Define('balance', 'flops', 'A method name or a list of layer counts.')
  assert q.FromText(p.ToText()).balance == [2, 4]
  q.FromText('balance : params')
  assert q.balance == 'params'
  q.FromText('balance : 7')
  assert q.balance == '7'
