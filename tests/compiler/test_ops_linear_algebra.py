"""torch.linalg's solvers and factorizations with unique results against torch: forward and
gradients (op parity harness), the checks of singular and not positive-definite inputs, and
orthogonal parametrizations trained as torch trains them. fp32: 1e-5 relative unless a case says
otherwise (inverses and exponentials lose a few bits to their condition)."""

import copy
import warnings

import pytest
import torch

import ipu_backend as poptorch
from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
LOOSER = {torch.float32: (1e-4, 1e-5)}


def matrices(*shapes):
    return lambda dtype: tuple(torch.randn(s, dtype=dtype) for s in shapes)


def conditioned(a):
    """A well-conditioned matrix (batch) from any square ``a``."""
    return a + 4 * torch.eye(a.shape[-1])


def positive_definite(a):
    return a @ a.mT + 3 * torch.eye(a.shape[-1])


def cholesky_deprecated(a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cholesky(positive_definite(a))


CASES = [
    OpCase("solve", lambda a, b: torch.linalg.solve(conditioned(a), b), matrices((2, 4, 4), (2, 4, 3)),
           ops=(aten.linalg_solve.default,)),
    OpCase("solve_vectors", lambda a, b: torch.linalg.solve(conditioned(a), b[..., 0]),
           matrices((2, 4, 4), (2, 4, 3)), ops=(aten.linalg_solve.default,)),
    OpCase("solve_right", lambda a, b: torch.linalg.solve(conditioned(a), b, left=False),
           matrices((2, 4, 4), (2, 3, 4)), ops=(aten.linalg_solve.default,)),
    OpCase("solve_ex", lambda a, b: torch.linalg.solve_ex(conditioned(a), b), matrices((4, 4), (4, 2)),
           ops=(aten._linalg_solve_ex.default,), tolerances=LOOSER),
    OpCase("inv", lambda a: torch.linalg.inv(conditioned(a)), matrices((2, 3, 3)), ops=(aten.linalg_inv.default,)),
    OpCase("inverse", lambda a: torch.inverse(conditioned(a)), matrices((3, 3)), ops=(aten.inverse.default,)),
    OpCase("inv_ex", lambda a: torch.linalg.inv_ex(conditioned(a)), matrices((3, 3)),
           ops=(aten.linalg_inv_ex.default,)),
    OpCase("det", torch.linalg.det, matrices((2, 4, 4)), ops=(aten._linalg_det.default,), tolerances=LOOSER),
    OpCase("slogdet", torch.linalg.slogdet, matrices((2, 4, 4)), ops=(aten._linalg_slogdet.default,)),
    OpCase("cholesky_upper", lambda a: torch.linalg.cholesky(positive_definite(a), upper=True), matrices((2, 4, 4)),
           ops=(aten.linalg_cholesky.default,)),
    OpCase("cholesky_deprecated", cholesky_deprecated, matrices((4, 4)), ops=(aten.cholesky.default,)),
    OpCase("cholesky_ex", lambda a: torch.linalg.cholesky_ex(positive_definite(a)), matrices((4, 4)),
           ops=(aten.linalg_cholesky_ex.default,)),
    OpCase("cholesky_solve", lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(positive_definite(a))),
           matrices((2, 4, 4), (4, 2)), ops=(aten.cholesky_solve.default,)),
    OpCase("solve_triangular", lambda a, b: torch.linalg.solve_triangular(conditioned(a).triu(), b, upper=True),
           matrices((2, 4, 4), (2, 4, 3)), ops=(aten.linalg_solve_triangular.default,)),
    OpCase("solve_triangular_right_unit",
           lambda a, b: torch.linalg.solve_triangular(a.tril(), b, upper=False, left=False, unitriangular=True),
           matrices((4, 4), (3, 4)), ops=(aten.linalg_solve_triangular.default,)),
    OpCase("pinv", torch.linalg.pinv, matrices((2, 5, 3)), ops=(aten.linalg_pinv.atol_rtol_tensor,),
           tolerances=LOOSER),
    OpCase("pinv_rtol", lambda a: torch.linalg.pinv(a, rtol=0.3), matrices((3, 5)),
           ops=(aten.linalg_pinv.atol_rtol_tensor,), tolerances=LOOSER),
    OpCase("pinv_atol", lambda a: torch.linalg.pinv(a, atol=0.5), matrices((3, 5)),
           ops=(aten.linalg_pinv.atol_rtol_tensor,), tolerances=LOOSER),
    OpCase("matrix_exp", lambda a: torch.linalg.matrix_exp(0.5 * a), matrices((2, 4, 4)),
           ops=(aten.linalg_matrix_exp.default,), tolerances=LOOSER),
    OpCase("householder_product", lambda a, tau: torch.linalg.householder_product(a, torch.tanh(tau)),
           matrices((2, 5, 3), (2, 3)), ops=(aten.linalg_householder_product.default,), tolerances=LOOSER),
]


@pytest.mark.parametrize("case, dtype", case_params(CASES))
def test_linear_algebra_matches_torch(case, dtype):
    check_case(case, dtype)


class Applies(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a):
        return self.fn(a)


SINGULAR = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 2.0], [2.0, 4.0]]])
NOT_POSITIVE_DEFINITE = torch.tensor([[[2.0, 1.0, 1.0], [1.0, 2.0, 1.0], [1.0, 1.0, -5.0]]])


@pytest.mark.parametrize("fn, message", [
    (lambda a: torch.linalg.solve(a, torch.ones(2, 2, 1)), r"torch\.linalg\.solve: .*singular"),
    (torch.linalg.inv, r"linalg\.inv: .*singular"),
    (torch.linalg.cholesky, r"linalg\.cholesky: .*not positive-definite"),
])
def test_a_singular_input_raises_as_in_torch(fn, message):
    a = NOT_POSITIVE_DEFINITE if fn is torch.linalg.cholesky else SINGULAR
    with pytest.raises(RuntimeError, match=message):
        fn(a)
    with pytest.raises(poptorch.Error, match=message + r".* \(at .*test_ops_linear_algebra\.py"):
        poptorch.inferenceModel(Applies(fn))(a)


@pytest.mark.parametrize("fn, a", [
    (lambda a: torch.linalg.solve_ex(a, torch.ones(2, 2, 1))[1], SINGULAR),
    (lambda a: torch.linalg.inv_ex(a)[1], SINGULAR),
    (lambda a: torch.linalg.cholesky_ex(a)[1], NOT_POSITIVE_DEFINITE),
], ids=["solve_ex", "inv_ex", "cholesky_ex"])
def test_the_ex_variants_return_lapacks_info_as_torch(fn, a):
    assert torch.equal(poptorch.inferenceModel(Applies(fn))(a), fn(a))


@pytest.mark.parametrize("shape", [(4, 4), (6, 3)], ids=["square_matrix_exp", "tall_householder"])
def test_an_orthogonal_parametrization_trains_as_in_torch(shape):
    torch.manual_seed(0)
    layer = torch.nn.utils.parametrizations.orthogonal(torch.nn.Linear(*shape))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, y):
            out = torch.tanh(self.layer(x))
            return out, ((out - y) ** 2).mean()

    model = Model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 8, shape[0]), torch.randn(4, 8, shape[1])
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        reference_optimizer.zero_grad()
        reference(x[step], y[step])[1].backward()
        reference_optimizer.step()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        training(x[step], y[step])
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(model.layer.weight, reference.layer.weight, rtol=1e-5, atol=1e-6)
