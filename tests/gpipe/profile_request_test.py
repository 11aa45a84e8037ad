"""Tests of gpipe.profile_request: which cells profile alike.

Protected properties: cells that differ only in names and seeds share a
signature, and so one profile; the first cell (no input gradient) and the
last (the loss) are apart from equal cells elsewhere; Select keeps each
cell's place in the pipeline, which decides both.
"""

from tfpipe import layers
from tfpipe.gpipe import cell as cell_lib
from tfpipe.gpipe import profile_request
from tfpipe.trainer import optimizer as optimizer_lib


def _Cell(name, dims=8, seed=None):
  return cell_lib.FeatureExtractionLayer.Params().Set(name=name, sub=[
      layers.FCLayer.Params().Set(name=f'{name}_fc', input_dims=dims,
                                  output_dims=dims, random_seed=seed)])


def test_names_and_seeds_do_not_part_cells_but_place_and_shape_do():
  a = profile_request.CellSignature(_Cell('a', seed=1), (None, 8), False,
                                    False)
  assert a == profile_request.CellSignature(_Cell('b', seed=2), (None, 8),
                                            False, False)
  assert a != profile_request.CellSignature(_Cell('a'), (None, 8), True,
                                            False)
  assert a != profile_request.CellSignature(_Cell('a'), (None, 8), False,
                                            True)
  assert a != profile_request.CellSignature(_Cell('a', dims=4), (None, 4),
                                            False, False)


def test_distinct_cells_are_the_first_of_each_signature_in_place():
  request = profile_request.ProfileRequest(
      [_Cell(n) for n in 'abcde'], [(None, 8)] * 5, None, None, None, [4],
      optimizer_lib.OptimizerParams())
  assert list(profile_request.DistinctCells(request).values()) == [0, 1, 4]
  request.Select([3, 4])
  assert request.positions == [3, 4] and request.num_cells == 5
  assert list(profile_request.DistinctCells(request).values()) == [0, 1]
