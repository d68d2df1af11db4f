"""View, shape, indexing, gather/scatter, padding and sorting lowerings against torch."""

import jax
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from ipu_backend import Error
from ipu_backend.compiler import compile_module, to_jax
from ipu_backend.compiler.dynamic_slicing import DYNAMIC_SLICE, DYNAMIC_UPDATE
from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOAT_AND_INT = (torch.float32, torch.int64)
HALF = (torch.float32, torch.bfloat16)
HALF_AND_INT = (torch.float32, torch.bfloat16, torch.int64)


def values(*shapes):
    """Random tensors of the case's dtype: normal floats, or small integers (bool: coin flips)."""
    def make(dtype):
        if dtype.is_floating_point:
            return tuple(torch.randn(s).to(dtype) for s in shapes)
        if dtype == torch.bool:
            return tuple(torch.rand(s) > 0.5 for s in shapes)
        low = 0 if dtype == torch.uint8 else -9
        return tuple(torch.randint(low, 10, s, dtype=dtype) for s in shapes)
    return make


def with_tensors(*shapes, extra=()):
    """Random tensors of the case's dtype followed by fixed tensors (indices, masks)."""
    return lambda dtype: values(*shapes)(dtype) + tuple(extra)


def long(*data):
    return torch.tensor(data, dtype=torch.long)


def mutated(write):
    """``write`` applied in place to a copy of the input (functionalized to *_scatter ops)."""
    def fn(x, *args):
        y = x.clone()
        write(y, *args)
        return y
    return fn


SHAPES = [
    OpCase("view_reshape_permute",
           lambda x: (x.view(4, -1), x.flatten(1), x.reshape(2, 3, 2, 2), x.view(-1),
                      x.permute(2, 0, 1).reshape(4, 6), x.transpose(1, 2).flatten(),
                      x.permute(2, -3, 1), x.transpose(0, -1), x.movedim(0, -1), x.mT, x[0].t()),
           values((2, 3, 4)),
           ops=(aten.view.default, aten.clone.default, aten.permute.default)),
    OpCase("expand_squeeze_unsqueeze",
           lambda x, y, s: (x[:, :1].expand(-1, 4, -1), x[0].expand(2, 3, 4, 5), s.expand(2, 3),
                            x[:1].expand_as(y), y[:1, :, :1].squeeze(), y[:, :1].squeeze(-2),
                            y[:1, :, :1].squeeze((0, 2)), s.squeeze(0), x.squeeze(1),
                            x.unsqueeze(-1), x[:, None, ..., None], s.unsqueeze(0)),
           values((3, 4, 5), (3, 4, 5), ()),
           ops=(aten.expand.default, aten.squeeze.dims, aten.unsqueeze.default)),
    OpCase("cat_stack",
           lambda x, y, empty: (torch.cat([x, y, x], -1), torch.cat([empty, x, empty], 0),
                                torch.cat([y[..., :0], x[..., :1]], 2), torch.stack([x, x], -1),
                                torch.stack([y, y]), torch.cat([empty, empty])),
           values((2, 3, 4), (2, 3, 2), (0,)), ops=(aten.cat.default,)),
    OpCase("cat_promotes_int_to_float",
           lambda x, i: torch.cat([i, x]), with_tensors((3,), extra=(long(1, -2),)),
           ops=(aten.cat.default,)),
    OpCase("split_chunk_unbind",
           lambda x: (*x.split(2, 1), *x.split([1, 3, 1], 1), *x.split([2, 1], -1), *x.chunk(3, 1),
                      *x.unbind(-1), *x.tensor_split(3, 1)),
           values((2, 5, 3)), ops=(aten.split_with_sizes.default, aten.slice.Tensor, aten.squeeze.dims)),
    OpCase("slice_narrow_select",
           lambda x: (x[1:, ::2, -3:], x[:, -100:100], x[2:1], x[..., 1::3], x[-1:, :, 4:9],
                      x.narrow(1, 1, 2), x.narrow(-1, -3, 3),
                      x[-1], x[:, -2], x.select(2, 3), x[1, 2, -5], x[..., 0]),
           values((3, 4, 5)), ops=(aten.slice.Tensor, aten.select.int)),
    OpCase("alias_of_whole_slice", lambda x: x[:, :], values((3, 4)), ops=(aten.alias.default,)),
    OpCase("detach_stops_gradients", lambda x: (x * x.detach(), x.detach().exp() + x),
           values((3, 4)), ops=(aten.detach.default,)),
    OpCase("clone_memory_format",
           lambda x: (x.clone(memory_format=torch.channels_last), x.transpose(1, 2).contiguous()),
           values((2, 3, 4, 5)), ops=(aten.clone.default,)),
    OpCase("flip_repeat",
           lambda x: (x.flip(0, -1), x.flip(1), x.fliplr(), x.rot90(1, (1, 2)),
                      x.repeat(2, 1, 3), x.repeat(2, 1, 1, 2), x.tile(2), x.repeat(1, 0, 1)),
           values((2, 3, 4)), ops=(aten.flip.default, aten.repeat.default)),
    OpCase("repeat_interleave",
           lambda x, r: (x.repeat_interleave(2, 1), x.repeat_interleave(3),
                         x.repeat_interleave(r, 1, output_size=7)),
           with_tensors((2, 4), extra=(long(1, 3, 0, 3),)),
           ops=(aten.expand.default, aten.repeat_interleave.Tensor, aten.index_select.default)),
    OpCase("diagonal_unfold",
           lambda x, s: (x.diagonal(), x.diagonal(1, 1, 2), x.diagonal(-2, 0, -1), x.diagonal(7),
                         torch.diag(x[0], -1), x.unfold(2, 3, 1), x.unfold(-1, 2, 3), x.unfold(0, 2, 1),
                         x.unfold(1, 4, 4), s.unfold(0, 1, 1)),
           values((3, 4, 7), ()), ops=(aten.diagonal.default, aten.unfold.default)),
    OpCase("shape_ops_on_integers",
           lambda x, y, s: (x.view(4, -1), x.transpose(1, 2).flatten(), x.permute(2, -3, 1),
                            x[:, :1].expand(-1, 4, -1), s.expand(2, 3), x[:1].squeeze(0), x.unsqueeze(-1),
                            torch.cat([x, y], -1), *x.split([1, 2], 1), x[1:, ::2, -3:], x[-1, :, 2],
                            x.flip(0, -1), x.repeat(1, 2, 1), x.diagonal(1, 1, 2), x.unfold(-1, 2, 1),
                            F.pad(x, (1, -1, 2, 0), value=3), torch.slice_scatter(x, y, -1, 1, 3),
                            torch.diagonal_scatter(x, y[0], 0, 0, -1)),
           values((2, 3, 4), (2, 3, 2), ()), (torch.int64,),
           ops=(aten.view.default, aten.permute.default, aten.expand.default, aten.squeeze.dims,
                aten.unsqueeze.default, aten.cat.default, aten.split_with_sizes.default,
                aten.slice.Tensor, aten.select.int, aten.flip.default, aten.repeat.default,
                aten.diagonal.default, aten.unfold.default, aten.constant_pad_nd.default,
                aten.slice_scatter.default, aten.diagonal_scatter.default)),
    OpCase("view_dtype",
           lambda x, h: (x.view(torch.int32), h.view(torch.int16), h.view(torch.bfloat16),
                         x.view(torch.int16), h.view(torch.float32), x.view(torch.uint8)),
           lambda dtype: (torch.randn(3, 4), torch.randn(3, 4).half()), grad=False,
           ops=(aten.view.dtype,)),
]

PADDING = [
    OpCase("constant_pad",
           lambda x: (F.pad(x, (1, 2)), F.pad(x, (1, -1, 2, 0), value=3.5), F.pad(x, (0, 0, 0, 0, -1, 1)),
                      F.pad(x, (-2, -1, -1, -2))),
           values((2, 4, 5)), ops=(aten.constant_pad_nd.default,)),
    OpCase("reflect_replicate_pad",
           lambda x: (F.pad(x, (2, 1), mode="reflect"), F.pad(x, (2, 1, 1, 3), mode="reflect"),
                      F.pad(x, (3, 1), mode="replicate"), F.pad(x, (1, 2, 2, 0), mode="replicate")),
           values((2, 4, 5)), ops=(aten.index.Tensor,)),
    OpCase("circular_pad", lambda x: F.pad(x, (2, 1, 1, 1), mode="circular"), values((1, 2, 3, 4)),
           ops=(aten.slice_scatter.default, aten.copy.default)),
]

WRITES = [
    OpCase("setitem_slice_tensor",
           mutated(lambda y, v: y.__setitem__((slice(None), slice(1, 3)), v)),
           values((3, 4, 5), (2, 1)),
           ops=(aten.copy.default, aten.slice_scatter.default)),
    OpCase("slice_scatter",
           lambda x, v: (torch.slice_scatter(x, v, 1, 1, None, 2), torch.slice_scatter(x, v, -2, -3, -1)),
           values((3, 5, 4), (3, 2, 4)), ops=(aten.slice_scatter.default,)),
    OpCase("diagonal_scatter",
           lambda x, d, e: (torch.diagonal_scatter(x, d), torch.diagonal_scatter(x, e, -1, 0, 2)),
           values((3, 4, 5), (5, 3), (4, 2)), ops=(aten.diagonal_scatter.default,)),
]

INDEXING = [
    OpCase("index_one_tensor_with_duplicates",
           lambda x, i: (x[i], x[:, i], x[..., i], x.permute(2, 0, 1)[i]),
           with_tensors((4, 4, 4), extra=(long(0, 3, -1, 0, 2),)), FLOAT_AND_INT,
           ops=(aten.index.Tensor,)),
    OpCase("index_several_tensors",
           lambda x, i, j: (x[i, :, j], x[:, i, j], x[i[:, None], j], x[i[:, None], :, j], x[:, None, i],
                            x[i, j, i]),
           with_tensors((3, 4, 5), extra=(long(0, 2, -1), long(1, 1, -4))),
           ops=(aten.index.Tensor,)),
    OpCase("index_zero_dim_and_2d_index",
           lambda x, s, m: (aten.index(x, [s]), x[:, m], x[m, m]),
           with_tensors((3, 4), extra=(torch.tensor(2), long(0, 1, 2, 1, 0, 2).view(2, 3))),
           ops=(aten.index.Tensor,)),
    OpCase("index_put_set",
           lambda x, v, i, j: (x.index_put((i,), v[0]), aten.index_put(x, [i, None, j], v[1, :, 0]),
                               aten.index_put(x, [None, None, j], torch.tensor(7.0))),
           with_tensors((4, 3, 5), (2, 3, 5), extra=(long(0, -1, 2), long(1, 4, 0))),
           ops=(aten.index_put.default,)),
    OpCase("index_put_accumulate_duplicates",
           lambda x, v, i, j: (x.index_put((i,), v, accumulate=True),
                               x.index_put((i, j), v[:, 0, 0], accumulate=True)),
           with_tensors((4, 3, 5), (5, 3, 5), extra=(long(0, 3, 0, 0, -1), long(1, 1, 1, 2, 1))),
           HALF_AND_INT, ops=(aten.index_put.default,)),
    OpCase("index_add_copy_fill",
           lambda x, v, i: (x.index_add(1, i, v), x.index_copy(1, i[:2], v[:, :2]), x.index_fill(-1, i, 2.0),
                            x.index_add(1, i, v, alpha=2)),
           with_tensors((3, 4, 5), (3, 3, 5), extra=(long(2, 0, 2),)),
           ops=(aten.index_put.default,)),
    OpCase("setitem_index_tensor",
           mutated(lambda y, v, i: y.__setitem__(i, v)),
           with_tensors((5, 3), (3,), extra=(long(4, 0, -2),)),
           ops=(aten.index_put.default,)),
    OpCase("setitem_bool_mask",
           lambda x, v, m, r: (mutated(lambda y: y.__setitem__(m, 0))(x),
                               mutated(lambda y: y.__setitem__((slice(None), r), v[:2]))(x),
                               x.index_put((m,), torch.tensor(1.5), accumulate=True)),
           with_tensors((3, 4), (4,), extra=(torch.tensor([[True, False, True, True]] * 3),
                                              torch.tensor([False, True, True, False]))),
           ops=(aten.index_put.default,)),
    OpCase("setitem_bool_mask_rows_of_values",
           lambda x, v, rows, cols: (x.index_put((rows,), v[:2]),
                                     aten.index_put(x, [None, cols], v[:, :3], True)),
           with_tensors((3, 4), (3, 4), extra=(torch.tensor([False, True, True]),
                                                torch.tensor([True, False, True, True]))),
           ops=(aten.index_put.default,)),
    OpCase("index_select",
           lambda x, i: (x.index_select(1, i), x.index_select(-1, i[:1]), x.index_select(0, i[1]),
                         x[0, 0, 0].index_select(0, i[1])),
           with_tensors((3, 4, 5), extra=(long(3, 0, 3, 1),)),
           ops=(aten.index_select.default,)),
    OpCase("roll", lambda x: (x.roll(2, 1), x.roll((-1, 3), (0, 2)), x.roll(5)), values((3, 4, 5)),
           ops=(aten.index_select.default,)),
    OpCase("masked_scatter",
           lambda x, s, m, none: (x.masked_scatter(m, s), x.masked_scatter(m[0], s),
                                  x.masked_scatter(none, s[:0])),
           with_tensors((3, 4), (20,), extra=(torch.tensor([[True, False, True, True]] * 3),
                                              torch.zeros(3, 4, dtype=torch.bool))),
           FLOAT_AND_INT, ops=(aten.masked_scatter.default,)),
]

def scatter_inputs(*shapes):
    """Random tensors, then indices: values below 4 in shape (3, 6, 5) (for dim 1 of a
    (3, 4, 5) tensor) and values below 3 in shape (3, 4, 5) (valid along any dim)."""
    return lambda dtype: values(*shapes)(dtype) + (torch.randint(0, 4, (3, 6, 5)),
                                                   torch.randint(0, 3, (3, 4, 5)))


def unique_scatter_inputs(dtype):
    """Indices with no duplicate target in a line (torch's scatter is undefined for those):
    permutations along dim 1, and the first 3 of permutations along dim 2."""
    return values((3, 4, 5), (3, 4, 5))(dtype) + (torch.rand(3, 4, 5).argsort(1),
                                                  torch.rand(3, 4, 5).argsort(-1)[..., :3])


GATHER_SCATTER = [
    OpCase("gather",
           lambda x, i, small: (x.gather(1, i), x.gather(-1, small[:, :2, :2]), x.gather(0, small[:2])),
           scatter_inputs((3, 4, 5)), FLOAT_AND_INT, ops=(aten.gather.default,)),
    OpCase("gather_long_dim_indexes", lambda x, i: x.gather(1, i),  # past COMPARISON_GATHER_LIMIT
           with_tensors((2, 1500), extra=(torch.randint(0, 1500, (2, 3)),)), ops=(aten.gather.default,)),
    OpCase("gather_skips_nan_elsewhere", lambda x, i: x.masked_fill(x > 1, float("nan")).gather(1, i),
           with_tensors((4, 10), extra=(torch.tensor([[0], [3], [9], [5]]),)), ops=(aten.gather.default,)),
    OpCase("gather_0d", lambda x, i: x.gather(0, i), with_tensors((), extra=(torch.tensor(0),)),
           ops=(aten.gather.default,)),
    OpCase("take_along_dim", lambda x, i: torch.take_along_dim(x, i, 1),
           with_tensors((3, 4, 5), extra=(torch.randint(0, 4, (1, 2, 5)),)), ops=(aten.gather.default,)),
    OpCase("scatter_src_value",
           lambda x, s, i, j: (x.scatter(1, i, s), x.scatter(-1, j, s[..., :3]), x.scatter(1, i, 2.5)),
           unique_scatter_inputs, FLOAT_AND_INT, ops=(aten.scatter.src, aten.scatter.value)),
    OpCase("scatter_add_duplicates",
           lambda x, s, i, small: (x.scatter_add(1, i, s), x.scatter_add(0, small[:1, :1], s[:1, :1])),
           scatter_inputs((3, 4, 5), (3, 6, 5)), HALF_AND_INT,
           ops=(aten.scatter_add.default,)),
    OpCase("scatter_reduce_arg_deprecated",
           lambda x, s, i, small: (x.scatter(1, i, s, reduce="add"), x.scatter(1, i, s, reduce="multiply"),
                                   x.scatter(1, i, 2.0, reduce="multiply"),
                                   x.scatter(0, small, 3.0, reduce="add")),
           scatter_inputs((3, 4, 5), (3, 6, 5)), FLOAT_AND_INT, grad=False,
           ops=(aten.scatter.reduce, aten.scatter.value_reduce)),
]


def scatter_reduce_inputs(dtype):
    """Duplicate targets and an untouched target (row 3), with zeros for prod and ties for
    amax/amin: column 0 has a zero in self and one in src at target 0; column 1 two zeros at
    target 1; column 2 a three-way tie (two src and self) for the max at target 2 and self tied
    with its only src at target 0."""
    x = torch.tensor([[0, 2, 1], [-1, 3, -2], [2, -3, 4], [1, 1, 5]]).to(dtype)
    src = torch.tensor([[0, 2, 1], [5, 0, 4], [2, 0, 4], [3, 1, -2], [1, 1, 0]]).to(dtype)
    index = torch.tensor([[0, 1, 0], [0, 1, 2], [1, 1, 2], [0, 0, 1], [2, 2, 2]])
    return x, src, index


SCATTER_REDUCE = [
    OpCase(f"scatter_reduce_{reduce}",
           lambda x, s, i, reduce=reduce: (x.scatter_reduce(0, i, s, reduce),
                                           x.scatter_reduce(0, i, s, reduce, include_self=False),
                                           x.T.scatter_reduce(-1, i.T, s.T, reduce)),
           scatter_reduce_inputs, HALF_AND_INT,
           ops=(aten.scatter_reduce.two,))
    for reduce in ("sum", "prod", "mean", "amax", "amin")
] + [
    OpCase(f"index_reduce_{reduce}",
           lambda x, s, i, reduce=reduce: (x.index_reduce(0, i[:, 0], s, reduce),
                                           x.index_reduce(0, i[:, 0], s, reduce, include_self=False),
                                           x.T.index_reduce(-1, i[:, 2], s.T, reduce, include_self=False)),
           scatter_reduce_inputs, HALF_AND_INT,
           ops=(aten.index_reduce.default,))
    for reduce in ("prod", "mean", "amax", "amin")
]


EMBEDDING_SORTING = [
    OpCase("embedding_padding_idx",
           lambda w, i: (F.embedding(i, w, padding_idx=1), F.embedding(i[0], w, padding_idx=-1)),
           with_tensors((6, 3), extra=(long(1, 0, 1, 5, 0, 1).view(2, 3),)), HALF,
           ops=(aten.embedding.default,)),
    OpCase("embedding_scale_grad_by_freq",
           lambda w, i: (F.embedding(i, w, scale_grad_by_freq=True),
                         F.embedding(i, w, padding_idx=0, scale_grad_by_freq=True)),
           with_tensors((6, 3), extra=(long(2, 0, 2, 5, 2, 0),)), HALF, ops=(aten.embedding.default,)),
    OpCase("sort_stable_ties_nan_signed_zero",
           lambda x: (*x.sort(dim=1, stable=True), *x.sort(dim=-1, descending=True, stable=True),
                      *x.sort(dim=0, stable=True, descending=True)),
           lambda dtype: (torch.tensor([[1., 2, 1, 2, 0, -0., float("nan"), 2] * 3,
                                        [3, -1, float("nan"), 3, -0., 0, -1, 3] * 3]).to(dtype),),
           (torch.float32, torch.float16), ops=(aten.sort.stable,)),
    OpCase("sort_default_and_argsort",
           lambda x: (*x.sort(), *x.sort(0, descending=True), x.argsort(1), x.argsort(descending=True),
                      torch.msort(x)),
           values((3, 16)), FLOAT_AND_INT, ops=(aten.sort.default,)),
    OpCase("sort_ints_stable",
           lambda x: (*x.sort(stable=True), *x.sort(stable=True, descending=True)),
           values((4, 40)), (torch.int64, torch.uint8, torch.bool), ops=(aten.sort.stable,)),
    OpCase("topk",
           lambda x: (*x.topk(3), *x.topk(2, 0, largest=False), *x.topk(4, -1, largest=False),
                      *x.topk(1, 1)),
           lambda dtype: ((torch.randperm(21).view(3, 7) - 10).to(dtype),), FLOAT_AND_INT,
           ops=(aten.topk.default,)),
    OpCase("kthvalue",
           lambda x: (*x.kthvalue(3), *x.kthvalue(2, 0, keepdim=True), *x.kthvalue(7, -1)),
           lambda dtype: ((torch.randperm(21).view(3, 7) - 10).to(dtype),), FLOAT_AND_INT,
           ops=(aten.kthvalue.default,)),
    OpCase("searchsorted",
           lambda sequence, x: (torch.searchsorted(sequence[0], x), torch.searchsorted(sequence[0], x, right=True),
                                torch.searchsorted(sequence, x.view(3, 4), side="right", out_int32=True),
                                torch.searchsorted(sequence.flip(-1), x.view(3, 4),
                                                   sorter=torch.arange(4).flip(0).expand(3, 4).contiguous())),
           lambda dtype: (torch.tensor([[-1, 0, 0, 2], [-3, -1, 1, 1], [0, 1, 2, 3]]).to(dtype),
                          torch.tensor([-2, -1, 0, 1, 2, 3, 0, 1, -4, 5, 2, 1]).to(dtype)),
           FLOAT_AND_INT, grad=False, ops=(aten.searchsorted.Tensor,)),
    OpCase("bucketize",
           lambda x, boundaries: (torch.bucketize(x, boundaries), torch.bucketize(x, boundaries, right=True),
                                  torch.bucketize(x[1, 2], boundaries, out_int32=True),
                                  torch.bucketize(x, boundaries.int()), torch.bucketize(x.int(), boundaries + 0.5)),
           lambda dtype: (torch.tensor([[-2.0, -1.0, 0.0, 0.2], [0.5, 0.7, 1.0, 3.0]]).to(dtype),
                          torch.tensor([-1.0, 0.0, 0.5, 1.0]).to(dtype)),
           FLOAT_AND_INT, grad=False, ops=(aten.bucketize.Tensor,)),
    OpCase("binary_search_nan_and_unsorted",
           lambda x, sorted_, unsorted: (torch.bucketize(x, sorted_), torch.searchsorted(sorted_, x, right=True),
                                         torch.bucketize(x, unsorted, right=True), torch.searchsorted(unsorted, x)),
           lambda dtype: (torch.tensor([float("nan"), -3.0, 0.0, 0.5, 7.0, float("inf"), 1.0, 4.0]),
                          torch.tensor([-1.0, 0.0, 0.0, 1.0, 2.0, float("nan")]),
                          torch.tensor([1.0, float("nan"), 0.0, 5.0, -2.0, 3.0, 2.0])),
           grad=False, ops=(aten.bucketize.Tensor, aten.searchsorted.Tensor)),
]

DYNAMIC_SLICING = [
    OpCase(f"dynamic_slice_start_{start}",
           lambda x, s: ipu_backend.dynamic_slice(x, 1, s, 4, 2) * 2,
           lambda dtype, s=start: (torch.randn(3, 7, dtype=dtype), torch.tensor([s])), ops=(DYNAMIC_SLICE,))
    for start in (1, 6)      # 6 overruns and is moved back into range, as on an IPU
] + [
    OpCase("dynamic_update", lambda x, src, s: ipu_backend.dynamic_update(x.exp(), src * 3, 0, s, 2),
           lambda dtype: (torch.randn(5, 3, dtype=dtype), torch.randn(2, 3, dtype=dtype), torch.tensor(2)),
           ops=(DYNAMIC_UPDATE,)),
]

CASES = (SHAPES + PADDING + WRITES + INDEXING + GATHER_SCATTER + SCATTER_REDUCE + EMBEDDING_SORTING
         + DYNAMIC_SLICING)


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter:UserWarning")
@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_views(case, dtype):
    check_case(case, dtype)


class PositiveMean(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].mean()


def test_boolean_mask_indexing_is_an_error_naming_the_line():
    """``x[mask]`` has a shape that depends on the data: torch.export keeps it with unbacked
    sizes, which a compiled program cannot have; the user gets an Error naming the line."""
    with pytest.raises(Error, match=r"test_ops_views.py:\d+: return x\[x > 0\]"):
        compile_module(PositiveMean(), (torch.randn(3, 4),))


class BitsAsInt64(torch.nn.Module):
    def forward(self, x):
        return x.view(torch.int64)


def test_view_dtype_of_a_64_bit_type_is_an_error():
    """int64/float64 are carried as 32-bit, so their bits cannot be reinterpreted as torch's."""
    program = compile_module(BitsAsInt64(), (torch.randn(3, 4),))
    with pytest.raises(Error, match=r"use x.to\(dtype\)"):
        program.fn({}, {}, (to_jax(torch.randn(3, 4)),), jax.random.key(0))
