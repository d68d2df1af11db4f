"""``torch.linalg``'s solvers and factorizations whose results are unique: solve, inverse,
determinants, Cholesky, triangular solves, the pseudo-inverse, the matrix exponential and
Householder products (``nn.utils.parametrizations.orthogonal``). Their gradients are JAX's derivatives of the same
functions, equal to torch's formulas up to rounding.

``torch.linalg.solve``, ``inv`` and ``cholesky`` raise on a singular (or, for Cholesky, not
positive-definite) input; they are kept whole through decomposition (``capture._KEPT_WHOLE``),
and the compiled call raises torch's message once it is over (``runtime_checks``). Their ``_ex``
variants return LAPACK's ``info`` as torch does. QR, SVD and eigendecompositions are unique only
up to signs, which another LAPACK may choose otherwise than torch's: they have no lowering.
"""

import functools

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ipu_backend.compiler.registry import lowering
from ipu_backend.compiler.runtime_checks import report

aten = torch.ops.aten


def _lu(a):
    """``(LU, pivots, info)`` as LAPACK's ``getrf`` gives them: 1-based int32 pivots, and the
    1-based index of the first zero on U's diagonal (0 when there is none)."""
    lu, pivots, _ = lax.linalg.lu(a)
    return lu, pivots.astype(jnp.int32) + 1, _first_zero(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)


def _first_zero(flags):
    """The 1-based index of the first true flag along the last axis, 0 when none is."""
    return jnp.where(jnp.any(flags, axis=-1), jnp.argmax(flags, axis=-1) + 1, 0).astype(jnp.int32)


def _solve(result, a, b, left):
    """``A X = B`` (``X A = B`` unless ``left``), torch's ``result`` (its fake tensor) telling
    whether ``B`` is one vector per matrix."""
    vector = b.ndim == 1 or (result.ndim == b.ndim and b.ndim == a.ndim - 1)
    if vector:
        b = b[..., None]
    if not left:
        a, b = jnp.swapaxes(a, -1, -2), jnp.swapaxes(b, -1, -2)
    x = jnp.linalg.solve(a, jnp.broadcast_to(b, jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + b.shape[-2:]))
    if not left:
        x = jnp.swapaxes(x, -1, -2)
    return x[..., 0] if vector else x


def _raise_where(ctx, info, message: str) -> None:
    report(jnp.any(info > 0), f"{message} (at {ctx.location()})")


@lowering(aten._linalg_solve_ex.default)
def linalg_solve_ex(ctx, a, b, left=True, check_errors=False):
    lu, pivots, info = _lu(a)
    return _solve(ctx.out[0], a, b, left), lu, pivots, info


@lowering(aten.linalg_solve.default)
def linalg_solve(ctx, a, b, *, left=True):
    _raise_where(ctx, _lu(a)[2], "torch.linalg.solve: The solver failed because the input matrix is singular.")
    return _solve(ctx.out, a, b, left)


@lowering(aten.linalg_inv_ex.default)
def linalg_inv_ex(ctx, a, check_errors=False):
    return jnp.linalg.inv(a), _lu(a)[2]


@lowering(aten.linalg_inv.default, aten.inverse.default)
def linalg_inv(ctx, a):
    _raise_where(ctx, _lu(a)[2], "linalg.inv: A diagonal element of U is zero, the inversion could not be "
                 "completed because the input matrix is singular.")
    return jnp.linalg.inv(a)


@lowering(aten._linalg_det.default)
def linalg_det(ctx, a):
    lu, pivots, _ = _lu(a)
    return jnp.linalg.det(a), lu, pivots


@lowering(aten._linalg_slogdet.default)
def linalg_slogdet(ctx, a):
    lu, pivots, _ = _lu(a)
    sign, logabsdet = jnp.linalg.slogdet(a)
    return sign, logabsdet, lu, pivots


def _cholesky(a, upper: bool):
    lower = lax.linalg.cholesky(a, symmetrize_input=False)
    return jnp.conj(jnp.swapaxes(lower, -1, -2)) if upper else lower


def _cholesky_info(a):
    """LAPACK ``potrf``'s ``info``: the order of the first leading minor that is not positive-
    definite, 0 when all are: where the determinants of the leading minors stop being positive."""
    n = a.shape[-1]
    signs = jnp.stack([jnp.linalg.slogdet(a[..., :k, :k])[0] for k in range(1, n + 1)], axis=-1)
    return _first_zero(signs <= 0)


@lowering(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(ctx, a, upper=False, check_errors=False):
    factor = _cholesky(a, upper)
    failed = ~jnp.all(jnp.isfinite(factor), axis=(-2, -1))
    info = lax.cond(jnp.any(failed), _cholesky_info, lambda m: jnp.zeros(m.shape[:-2], jnp.int32), a)
    return factor, info


@lowering(aten.linalg_cholesky.default, aten.cholesky.default)
def linalg_cholesky(ctx, a, upper=False):
    factor = _cholesky(a, upper)
    report(~jnp.all(jnp.isfinite(factor)),
           "linalg.cholesky: The factorization could not be completed because the input is not "
           f"positive-definite (at {ctx.location()})")
    return factor


@lowering(aten.cholesky_solve.default)
def cholesky_solve(ctx, b, factor, upper=False):
    lower = jnp.conj(jnp.swapaxes(factor, -1, -2)) if upper else factor
    shape = jnp.broadcast_shapes(lower.shape[:-2], b.shape[:-2])
    lower, b = jnp.broadcast_to(lower, shape + lower.shape[-2:]), jnp.broadcast_to(b, shape + b.shape[-2:])
    y = lax.linalg.triangular_solve(lower, b, left_side=True, lower=True)
    return lax.linalg.triangular_solve(lower, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True)


@lowering(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    shape = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = jnp.broadcast_to(a, shape + a.shape[-2:]), jnp.broadcast_to(b, shape + b.shape[-2:])
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular)


@lowering(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(ctx, a, atol=None, rtol=None, hermitian=False):
    """The pseudo-inverse from the singular values above torch's cutoff ``max(atol, rtol *
    largest)``; ``rtol`` not given is ``eps * max(m, n)``, or 0 where ``atol`` is positive. (It is
    unique, though the singular vectors it comes from are not.)"""
    atol = jnp.zeros((), a.dtype) if atol is None else jnp.asarray(atol, a.dtype)
    if rtol is None:
        rtol = jnp.where(atol > 0, 0, jnp.finfo(a.dtype).eps * max(a.shape[-2:])).astype(a.dtype)
    return _pinv(a, atol, jnp.asarray(rtol, a.dtype), hermitian)


def _adjoint(x):
    return jnp.conj(jnp.swapaxes(x, -1, -2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pinv(a, atol, rtol, hermitian):
    u, s, vh = jnp.linalg.svd(a, full_matrices=False, hermitian=hermitian)
    cutoff = jnp.maximum(atol[..., None], rtol[..., None] * s[..., :1])
    kept = s > cutoff
    inverse = jnp.where(kept, 1 / jnp.where(kept, s, 1), 0)
    return _adjoint(vh) @ (inverse[..., :, None] * _adjoint(u))


def _pinv_forward(a, atol, rtol, hermitian):
    pinv = _pinv(a, atol, rtol, hermitian)
    return pinv, (a, pinv, atol, rtol)


def _pinv_backward(hermitian, saved, grad):
    """torch's gradient of the pseudo-inverse (its rank held fixed), whose grouping of products
    follows the smaller dimension as torch's does; differentiating the singular value
    decomposition instead would also move the values the cutoff drops."""
    a, pinv, atol, rtol = saved
    pinv_h, grad_h = _adjoint(pinv), _adjoint(grad)
    if a.shape[-2] <= a.shape[-1]:
        k = grad_h @ pinv
        k_pinv_h = k @ pinv_h
        gradient = -_adjoint(pinv @ k) + k_pinv_h - (a @ pinv) @ k_pinv_h + (pinv_h @ pinv) @ (grad_h - k @ a)
    else:
        k = pinv @ grad_h
        pinv_h_k = pinv_h @ k
        gradient = -_adjoint(k @ pinv) + pinv_h_k - pinv_h_k @ pinv @ a + (grad_h - a @ k) @ pinv @ pinv_h
    return gradient, jnp.zeros_like(atol), jnp.zeros_like(rtol)


_pinv.defvjp(_pinv_forward, _pinv_backward)


@lowering(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(ctx, a):
    return jax.scipy.linalg.expm(a)


@lowering(aten.linalg_householder_product.default)
def linalg_householder_product(ctx, reflectors, tau):
    """``H_1 ... H_k`` (its first ``n`` columns), ``H_i = I - tau_i v_i v_i^H`` with ``v_i`` the
    ``i``-th column of ``reflectors`` below the diagonal and 1 on it, applied right to left."""
    m, n = reflectors.shape[-2:]
    rows = jnp.arange(m)[:, None]
    identity = jnp.broadcast_to(jnp.eye(m, n, dtype=reflectors.dtype), reflectors.shape)

    def reflect(q, i):
        column = jnp.take(reflectors, i, axis=-1)[..., :, None]
        v = jnp.where(rows > i, column, jnp.where(rows == i, 1, 0).astype(reflectors.dtype))
        scale = jnp.take(tau, i, axis=-1)[..., None, None]
        return q - scale * v * (jnp.conj(jnp.swapaxes(v, -1, -2)) @ q), None

    product, _ = lax.scan(reflect, identity, jnp.arange(tau.shape[-1])[::-1])
    return product
