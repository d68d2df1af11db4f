"""``poptorch.fps`` and ``poptorch.nearest`` against numpy renditions of torch_cluster's CPU
algorithms (written here: torch has no definition of either), eager and compiled, on
PopTorch's test parameters. The results are indices: compared exactly."""

import numpy as np
import pytest
import torch

import ipu_backend as poptorch
from ipu_backend import Error
from ipu_backend.compiler.point_clouds import FPS, NEAREST, sample_counts
from tests.compiler.harness import OpCase, case_params, check_case


def reference_fps(src: torch.Tensor, ptr, ratio, starts=None) -> np.ndarray:
    """torch_cluster's ``fps_cpu``: per segment, start at its first point (or ``starts[b]``),
    then take the point whose squared distance to those taken is largest (the first on a tie);
    ``ceil(size * ratio)`` points, the product in float32 with ``ratio`` in the points' dtype."""
    points = src.numpy()
    ratio_held = np.float32(np.asarray(ratio, dtype=points.dtype))
    counts = np.ceil(np.diff(ptr).astype(np.float32) * ratio_held).astype(int)
    accumulate = np.float32 if points.dtype == np.float16 else points.dtype

    def squared_distances(y, i):
        return ((y - y[i]) ** 2).astype(accumulate).sum(1).astype(points.dtype)

    taken = []
    for b, (begin, end, count) in enumerate(zip(ptr, ptr[1:], counts)):
        if count == 0:       # an empty segment: torch_cluster's write lands where the next one writes
            continue
        y = points[begin:end]
        index = 0 if starts is None else starts[b]
        distance = squared_distances(y, index)
        taken.append(begin + index)
        for _ in range(1, count):
            index = int(np.argmax(distance))
            taken.append(begin + index)
            distance = np.minimum(distance, squared_distances(y, index))
    return np.array(taken, dtype=np.int64)


def reference_nearest(x: torch.Tensor, y: torch.Tensor, batch_x=None, batch_y=None) -> np.ndarray:
    """torch_cluster's CPU ``nearest``: with batches, both sets moved and scaled together into
    [0, 1] and given the coordinate ``2 * D * batch``; then scipy's vector quantisation, the
    nearest of ``y`` by squared distance (float64 for half points), the first on a tie."""
    x, y = x.numpy(), y.numpy()
    if batch_x is not None or batch_y is not None:
        batch_x = np.zeros(len(x), int) if batch_x is None else np.asarray(batch_x)
        batch_y = np.zeros(len(y), int) if batch_y is None else np.asarray(batch_y)
        low = min(x.min(), y.min())
        x, y = x - low, y - low
        high = max(x.max(), y.max())
        x, y = x / high, y / high
        scale = 2 * x.shape[1]
        x = np.concatenate([x, (scale * batch_x.astype(x.dtype))[:, None]], 1)
        y = np.concatenate([y, (scale * batch_y.astype(y.dtype))[:, None]], 1)
    wide = np.float64 if x.dtype == np.float16 else x.dtype
    differences = x.astype(wide)[:, None, :] - y.astype(wide)[None, :, :]
    return (differences ** 2).sum(-1).argmin(1)


def batch_of(ptr):
    return [b for b, (begin, end) in enumerate(zip(ptr, ptr[1:])) for _ in range(begin, end)]


# PopTorch's test_fps parameters: one segment, then several segments of 19 points.
SINGLE_SEGMENT = [(shape, [0, shape[0]], ratio)
                  for shape in ((1, 2), (2, 19), (3, 10), (19, 3)) for ratio in (0.3, 0.5, 1.0)]
MULTI_SEGMENT = [((19, 3), ptr, ratio)
                 for ptr in ([0, 13, 19], [0, 2, 3, 4, 9, 11, 19], [0, 1, 3, 4, 9, 18, 19])
                 for ratio in (0.4, 0.6, 1.0)]
UNEVEN = [((25, 2), [0, 25], 0.6),           # 25 * 0.6 in float32 rounds up: 16 points (PopTorch: 15)
          ((12, 3), [3, 3, 7, 10], 0.5)]     # an empty segment; rows outside ptr never taken
FPS_CONFIGS = SINGLE_SEGMENT + MULTI_SEGMENT + UNEVEN


class FpsConfigs(torch.nn.Module):
    """Every configuration in one program (one compilation): ``fps`` of input ``i``."""

    def __init__(self, shapes, configs, random_start=False):
        super().__init__()
        self.calls = [(shapes.index(shape), ptr, ratio) for shape, ptr, ratio in configs]
        self.random_start = random_start

    def forward(self, *srcs):
        return tuple(poptorch.fps(srcs[i], ptr, ratio, self.random_start) for i, ptr, ratio in self.calls)


def test_fps_equals_torch_cluster_compiled_and_eager():
    torch.manual_seed(0)
    shapes = sorted({shape for shape, _, _ in FPS_CONFIGS})
    srcs = [torch.rand(shape) for shape in shapes]
    expected = [reference_fps(srcs[shapes.index(shape)], ptr, ratio) for shape, ptr, ratio in FPS_CONFIGS]
    model = FpsConfigs(shapes, FPS_CONFIGS)
    compiled = poptorch.inferenceModel(model)(*srcs)
    for config, want, got, eager in zip(FPS_CONFIGS, expected, compiled, model(*srcs)):
        assert got.dtype == eager.dtype == torch.int64, config
        np.testing.assert_array_equal(got.numpy(), want, err_msg=str(config))
        np.testing.assert_array_equal(eager.numpy(), want, err_msg=str(config))


def test_fps_sample_counts_round_as_torch_cluster():
    """``ceil(size * ratio)`` in float32, ``ratio`` held in the points' dtype (0.3 in half is
    0.30005: 10 points give 4)."""
    assert sample_counts([0, 25, 35], 0.6, torch.float32) == [16, 6]
    assert sample_counts([0, 10], 0.3, torch.float32) == [3]
    assert sample_counts([0, 10], 0.3, torch.float16) == [4]
    assert sample_counts([0, 10], 0.3, torch.float64) == [3]


def test_fps_half_points_compiled():
    torch.manual_seed(1)
    src = torch.rand(10, 3).half()
    model = poptorch.inferenceModel(FpsConfigs([(10, 3)], [((10, 3), [0, 4, 10], 0.3)]))
    (got,) = model(src)
    np.testing.assert_array_equal(got.numpy(), reference_fps(src, [0, 4, 10], 0.3))
    assert len(got) == 4


RANDOM_STARTS = [((29, 3), ptr, ratio) for ptr in ([0, 29], [0, 2, 6, 11, 28, 29]) for ratio in (1.0, 0.5)]


def test_fps_random_start_draws_the_first_point_then_samples_farthest():
    """The start of each segment is drawn (from the program's key: not torch_cluster's draws);
    the rest follows from it. At ratio 1 every segment is sampled whole (PopTorch's check)."""
    torch.manual_seed(2)
    src = torch.rand(29, 3)
    model = FpsConfigs([(29, 3)], RANDOM_STARTS, random_start=True)
    compiled = poptorch.inferenceModel(model, poptorch.Options().randomSeed(5))
    drawn = []
    for results in (compiled(src), model(src)):
        for (_, ptr, ratio), got in zip(RANDOM_STARTS, results):
            got = got.numpy()
            firsts = np.cumsum([0] + sample_counts(ptr, ratio, src.dtype))[:-1]
            starts = [got[first] - begin for first, begin in zip(firsts, ptr)]
            assert all(0 <= s < end - begin for s, begin, end in zip(starts, ptr, ptr[1:]))
            np.testing.assert_array_equal(got, reference_fps(src, ptr, ratio, starts))
            if ratio == 1.0:
                for begin, end in zip(ptr, ptr[1:]):
                    assert sorted(got[begin:end]) == list(range(begin, end))
            drawn += starts[1:4] if len(ptr) > 2 else []
    assert any(drawn)       # segments of 4, 5 and 17 points: a start of 0 in each is one chance in 340, per draw


def test_fps_in_a_training_model_equals_torch_on_the_reference_indices():
    """PopTorch's training case: the indices (no gradient), as floats, feed a linear layer."""
    torch.manual_seed(3)
    src, ptr, ratio = torch.rand(29, 3), [0, 2, 6, 11, 28, 29], 0.7
    width = sum(sample_counts(ptr, ratio, src.dtype))

    class Train(torch.nn.Module):
        def __init__(self, sample):
            super().__init__()
            self.sample = sample
            self.linear = torch.nn.Linear(width, width)

        def forward(self, src):
            out = self.linear(self.sample(src).float())
            return out, torch.nn.functional.mse_loss(out, torch.ones_like(out))

    model = Train(lambda s: poptorch.fps(s, ptr, ratio))
    reference = Train(lambda s: torch.from_numpy(reference_fps(s, ptr, ratio)))
    reference.load_state_dict(model.state_dict())
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    out, loss = training(src)
    expected_out, expected_loss = reference(src)
    expected_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.01).step()
    torch.testing.assert_close(out, expected_out.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    training.destroy()


def test_sampled_rows_train_as_in_torch():
    """Points computed by a layer, sampled and matched: the gradient reaches the layer through
    the rows the indices select (the ops themselves have none), as in torch eager."""
    class Sampled(torch.nn.Module):
        def __init__(self, sample):
            super().__init__()
            self.sample = sample
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x, y):
            points = self.linear(x)
            matched = self.sample(points, y)
            return points[matched[0]].sum() + 0.5 * points[matched[1]].sum()

    def compiled_ops(points, y):
        return poptorch.fps(points, [0, 10, 20], 0.5), poptorch.nearest(points, y, [0] * 10 + [1] * 10, [0, 0, 1])

    def reference_ops(points, y):
        points = points.detach()
        return (torch.from_numpy(reference_fps(points, [0, 10, 20], 0.5)),
                torch.from_numpy(reference_nearest(points, y, [0] * 10 + [1] * 10, [0, 0, 1])))

    torch.manual_seed(5)
    x, y = torch.randn(20, 3), torch.randn(3, 3)
    model, reference = Sampled(compiled_ops), Sampled(reference_ops)
    reference.load_state_dict(model.state_dict())
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    loss = training(x, y)
    expected = reference(x, y)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    training.destroy()


# PopTorch's test_nearest points: two batches of four, nearest of two points each.
NEAREST_X = torch.tensor([[-1, -1], [-1, 1], [1, 1], [1, -1], [-2, -2], [-2, 2], [2, 2], [2, -2]])
NEAREST_Y = torch.tensor([[-1, 0], [1, 0], [-2, 0], [2, 0]])
BATCH_X, BATCH_Y = [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1]


class Nearest(torch.nn.Module):
    def forward(self, *args):
        return poptorch.nearest(*args)


class NearestVariants(torch.nn.Module):
    """PopTorch's calls of test_nearest in one program: batches as lists, as tensors, mixed,
    one missing, none."""

    def __init__(self, batch_x, batch_y):
        super().__init__()
        self.batch_x, self.batch_y = batch_x, batch_y

    def forward(self, x, y, batch_x, batch_y):
        zeros_x, zeros_y = torch.zeros_like(batch_x), torch.zeros_like(batch_y)
        return (poptorch.nearest(x, y, self.batch_x, self.batch_y),
                poptorch.nearest(x, y, batch_x, batch_y),
                poptorch.nearest(x, y, self.batch_x, batch_y),
                poptorch.nearest(x, y, zeros_x),
                poptorch.nearest(x, y, None, zeros_y),
                poptorch.nearest(x, y))

    @staticmethod
    def expected(x, y, batch_x, batch_y):
        return [reference_nearest(x, y, *batches) for batches in
                [(batch_x, batch_y)] * 3 + [([0] * len(x), None), (None, [0] * len(y)), (None, None)]]


def check_nearest_variants(x, y, batch_x, batch_y):
    model = NearestVariants(batch_x, batch_y)
    args = (x, y, torch.tensor(batch_x), torch.tensor(batch_y))
    for results in (poptorch.inferenceModel(model)(*args), model(*args)):
        for i, (got, want) in enumerate(zip(results, model.expected(x, y, batch_x, batch_y))):
            assert got.dtype == torch.int64
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"call {i}, {x.dtype}")


@pytest.mark.parametrize("dtype", [torch.half, torch.float, torch.double])
def test_nearest_equals_torch_cluster_on_poptorchs_cases(dtype):
    check_nearest_variants(NEAREST_X.to(dtype), NEAREST_Y.to(dtype), BATCH_X, BATCH_Y)


@pytest.mark.parametrize("dims", [1, 3, 6])
def test_nearest_of_random_batched_points(dims):
    torch.manual_seed(dims)
    x, y = torch.randn(40, dims) * 3 + 1, torch.randn(17, dims) * 3 + 1
    check_nearest_variants(x, y, batch_of([0, 5, 21, 40]), batch_of([0, 3, 9, 17]))


def test_nearest_of_1d_points():
    torch.manual_seed(4)
    x, y = torch.randn(9), torch.randn(5)
    want = reference_nearest(x[:, None], y[:, None], [0] * 4 + [1] * 5, [0, 0, 1, 1, 1])
    for model in (poptorch.inferenceModel(Nearest()), Nearest()):
        np.testing.assert_array_equal(model(x, y, [0] * 4 + [1] * 5, [0, 0, 1, 1, 1]).numpy(), want)


CASES = [
    OpCase("fps_segments", lambda src: poptorch.fps(src * 2, [0, 5, 12, 20], 0.5),
           lambda dtype: (torch.rand(20, 3, dtype=dtype),), (torch.float32, torch.float16), ops=(FPS,)),
    OpCase("nearest_batches", lambda x, y: poptorch.nearest(x.exp(), y.exp(), [0] * 6 + [1] * 4, [0, 0, 1, 1, 1]),
           lambda dtype: (torch.randn(10, 3, dtype=dtype), torch.randn(5, 3, dtype=dtype)),
           ops=(NEAREST,)),
    OpCase("nearest_no_batches", lambda x, y: poptorch.nearest(x, y),
           lambda dtype: (torch.randn(10, 4, dtype=dtype), torch.randn(7, 4, dtype=dtype)),
           ops=(NEAREST,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_point_cloud_ops(case, dtype):
    check_case(case, dtype)


SRC = torch.rand(6, 2)


@pytest.mark.parametrize("args,error,message", [
    ((SRC.tolist(), [0, 6]), Error, "`fps` must take a torch.tensor input"),
    ((SRC, (0, 6)), Error, "`ptr` must be a list of integers"),
    ((SRC, [0]), Error, "`ptr` must contain at least 2 elements"),
    ((SRC, [0, 6], 1), Error, "`ratio` must be of float type"),
    ((SRC, [0, 6], 0.5, 1), Error, "`random_start` must be of bool type"),
    ((SRC, [0, 6], 0.0), Error, r"`ratio` \(0.0\) has to be in range \(0.0, 1.0>"),
    ((SRC, [0, 6], 1.5), Error, r"`ratio` \(1.5\) has to be in range"),
    ((SRC.flatten(), [0, 6]), Error, "`src` is supposed to be 2d Tensor, while it has 1 dims"),
    ((SRC, list(range(8))), Error, r"`ptr` length \(8\) is supposed to be at most"),
    ((SRC, [0, 4.0, 6]), Error, "`ptr` must be a list of integers"),
    ((SRC, [0, 4, 3]), Error, "must be non-decreasing offsets"),
    ((SRC, [0, 7]), Error, "must be non-decreasing offsets"),
    ((SRC.long(), [0, 6]), Error, "floating-point points"),
])
def test_fps_argument_errors(args, error, message):
    with pytest.raises(error, match=message):
        poptorch.fps(*args)


X, Y = NEAREST_X.float(), NEAREST_Y.float()


@pytest.mark.parametrize("args,error,message", [
    ((X.tolist(), Y), Error, "`nearest` must take a torch.tensor `x` input"),
    ((X, Y.tolist()), Error, "`nearest` must take a torch.tensor `y` input"),
    ((X, Y, (0,) * 8, BATCH_Y), Error, "`batch_x` and `batch_y` must be torch.Tensors or lists"),
    ((X[None], Y), ValueError, "`x` has 3 dims and `y` has 2 dims"),
    ((X, Y[:, :1]), ValueError, r"x.shape\[1\]=2 vs. y.shape\[1\]=1"),
    ((X.long(), Y), Error, "floating-point points"),
    ((X, Y[:0]), Error, "needs points in `x` and in `y`"),
    # PopTorch's invalid inputs: batch 1 only in batch_x, explicitly and with batch_y missing
    ((X, Y, BATCH_X, [0, 0, 0, 0]), ValueError, "Some batch indices occur in 'batch_x'"),
    ((X, Y, BATCH_X, None), ValueError, "Some batch indices occur in 'batch_x'"),
    ((X, Y, [0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 3, 3]), ValueError, "Some batch indices occur"),
    ((X, Y, [0, 0, 1, 0, 0, 0, 0], BATCH_Y), ValueError, "'batch_x' is not sorted"),
    ((X, Y, BATCH_X, [0, 0, 1, 0]), ValueError, "'batch_y' is not sorted"),
    ((X, Y, BATCH_X[:-1], BATCH_Y), ValueError, r"`batch_x` has 7 entries; .* of `x` \(8\)"),
    ((X, Y, torch.tensor(BATCH_X), torch.tensor([0, 0, 1, 0])), ValueError, "'batch_y' is not sorted"),
    ((X, Y, torch.tensor(BATCH_X, dtype=torch.float), BATCH_Y), Error, "1D integer tensor"),
])
def test_nearest_argument_errors(args, error, message):
    with pytest.raises(error, match=message) as raised:
        poptorch.nearest(*args)
    assert isinstance(raised.value, Error)


def test_nearest_checks_batch_tensor_sizes_when_compiled():
    """A compiled model cannot read its tensors' values (PopTorch does not check them either),
    but their sizes are checked."""
    model = poptorch.inferenceModel(Nearest())
    with pytest.raises(ValueError, match=r"`batch_y` has 3 entries; .* of `y` \(4\)"):
        model(X, Y, torch.tensor(BATCH_X), torch.tensor([0, 0, 1]))
