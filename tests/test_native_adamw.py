"""Native fused CPU AdamW kernel (megatrain_lightning.optim.native) against torch's optimizers.

Tolerance: torch.testing.assert_close(rtol=1e-6, atol=1e-7) on master, exp_avg and exp_avg_sq after
50 steps. The kernel does torch's single-tensor AdamW op by op with the same float constants, so the
only differences left are (1) torch's single-tensor path takes the square root with MKL's vectorized
sqrt, which is not correctly rounded (1-2 ulp off for ~20% of inputs), while the kernel and torch's
fused path use the exact sqrt instruction, and (2) torch's scalar loops over the last n % 8 elements
are compiled with a different FMA contraction than its vector loops. Each is an ulp-level change to
one step's update (a quantity bounded by lr), and Adam does not amplify it across steps: measured
worst cases are 1-2 ulp of the parameter (relative < 2e-7) for elements away from zero, and absolute
< 1e-7 for elements near zero, where a relative bound means nothing (hence atol = about 1 ulp of 1.0;
parameters, moments and gradients here are O(1)). Against torch's fused kernel the vector part is
bitwise equal. Different ISAs of the kernel (scalar, AVX2, AVX-512) must agree bitwise, and so must
different thread counts.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from megatrain_lightning.optim import native
from tests.helpers import (
    BETA1,
    BETA2,
    EPS,
    LR,
    adamw_grad,
    as_bits,
    assert_adamw_matches,
    requires_native,
    run_adamw_pair,
)

AVAILABLE = native.available()


def test_native_kernel_built_in_ci():
    """CI installs with `pip install -e .`, which builds the kernel: it must be there, not skipped."""
    if not os.environ.get("CI"):
        pytest.skip("only enforced when CI is set")
    assert native.available(), f"native AdamW kernel missing in CI: {native.load_error()}"
    assert native.backend().startswith("native-")


def _supported_isas() -> list[str]:
    if not AVAILABLE:
        return []
    best = native.info()["isa_supported"]
    return ["scalar", "avx2", "avx512"][: ["scalar", "avx2", "avx512"].index(best) + 1]


@pytest.fixture(autouse=True)
def _restore_settings():
    yield
    if AVAILABLE:
        native.set_isa(None)
        native.set_num_threads(None)


SMALL = [1, 7, 22, 4096]
BIG = 1_000_003
GRAD_DTYPES = [torch.float32, torch.bfloat16]


@requires_native
@pytest.mark.parametrize("grad_scale", [1.0, 0.37], ids=["noscale", "scale"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["wd0", "wd0.1"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["gf32", "gbf16"])
@pytest.mark.parametrize("ref_kind", ["single", "fused"])
@pytest.mark.parametrize("n", SMALL)
def test_matches_torch_adamw_small(n, ref_kind, grad_dtype, weight_decay, grad_scale):
    assert_adamw_matches(*run_adamw_pair(n, ref_kind, grad_dtype, weight_decay, grad_scale))


# 1_000_003 elements x 50 steps: a covering subset (every option value appears at least once)
@requires_native
@pytest.mark.parametrize(
    "ref_kind,grad_dtype,weight_decay,grad_scale",
    [
        ("single", torch.bfloat16, 0.1, 1.0),
        ("fused", torch.float32, 0.1, 0.37),
        ("single", torch.float32, 0.0, 0.37),
        ("fused", torch.bfloat16, 0.0, 1.0),
    ],
    ids=["single-gbf16-wd", "fused-gf32-wd-scale", "single-gf32-scale", "fused-gbf16"],
)
def test_matches_torch_adamw_big(ref_kind, grad_dtype, weight_decay, grad_scale):
    assert_adamw_matches(*run_adamw_pair(BIG, ref_kind, grad_dtype, weight_decay, grad_scale))


@requires_native
@pytest.mark.parametrize(
    "n,grad_dtype,grad_scale",
    [
        (7, torch.float32, 0.37),
        (7, torch.bfloat16, 1.0),
        (4096, torch.float32, 1.0),
        (4096, torch.bfloat16, 0.37),
        (BIG, torch.bfloat16, 1.0),
    ],
)
def test_l2_mode_matches_torch_adam(n, grad_dtype, grad_scale):
    assert_adamw_matches(*run_adamw_pair(n, "adam", grad_dtype, 0.1, grad_scale))


# 1 - beta1 >= 0.5 takes the other branch of torch's lerp (end - (end - start) * (1 - weight))
@requires_native
@pytest.mark.parametrize("beta1,beta2", [(0.3, 0.9), (0.0, 0.5), (0.5, 0.99)])
@pytest.mark.parametrize("ref_kind", ["single", "fused", "adam"])
def test_other_betas(ref_kind, beta1, beta2):
    assert_adamw_matches(*run_adamw_pair(4096 + 7, ref_kind, torch.bfloat16, 0.1, 1.0, beta1=beta1, beta2=beta2))


def _step_all_variants(n, seed=0, steps=3):
    """Run every grad dtype x copy kind x decay mode for a few steps; return all outputs."""
    out = []
    for grad_dtype in GRAD_DTYPES:
        for copy_dtype in (None, torch.float32, torch.bfloat16):
            for decoupled, wd in ((True, 0.0), (True, 0.1), (False, 0.1)):
                gen = torch.Generator().manual_seed(seed)
                master, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
                copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
                for step in range(1, steps + 1):
                    native.adamw_step_(
                        master,
                        m,
                        v,
                        adamw_grad(n, step, gen, grad_dtype),
                        copy,
                        lr=LR,
                        beta1=BETA1,
                        beta2=BETA2,
                        eps=EPS,
                        weight_decay=wd,
                        step=step,
                        grad_scale=0.5,
                        decoupled=decoupled,
                    )
                out += [master, m, v] + ([] if copy is None else [copy])
    return out


@requires_native
@pytest.mark.parametrize("n", [1, 15, 16, 33, 100_003])
def test_isas_and_thread_counts_agree_bitwise(n):
    isas = _supported_isas()
    native.set_isa("scalar")
    native.set_num_threads(1)
    expected = _step_all_variants(n)
    for isa in isas:
        for threads in (1, 2, 3):
            native.set_isa(isa)
            native.set_num_threads(threads)
            got = _step_all_variants(n)
            for a, b in zip(got, expected):
                assert torch.equal(as_bits(a), as_bits(b)), f"isa={isa} threads={threads} differs from scalar"


@requires_native
@pytest.mark.parametrize("n", [1, 15, 33, 100_003])
def test_a_peek_writes_the_steps_copy_to_the_bit_and_nothing_else(n):
    """adamw_peek_ (a speculative step's kernel) against adamw_step_ on the same inputs: the same copy, bit
    for bit, in every ISA, and master, m and v unchanged."""
    g = torch.Generator().manual_seed(n)
    for isa in _supported_isas():
        native.set_isa(isa)
        for grad_dtype in (torch.float32, torch.bfloat16):
            for copy_dtype in (torch.float32, torch.bfloat16):
                for decoupled, wd in ((True, 0.1), (False, 0.1), (True, 0.0)):
                    master, m = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
                    v = torch.rand(n, generator=g) * 0.01
                    grad = torch.randn(n, generator=g).to(grad_dtype)
                    hyper = dict(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd, step=3, decoupled=decoupled)
                    before = [t.clone() for t in (master, m, v)]
                    peeked = torch.empty(n, dtype=copy_dtype)
                    native.adamw_peek_(master, m, v, grad, peeked, **hyper)
                    assert all(torch.equal(as_bits(a), as_bits(b)) for a, b in zip((master, m, v), before))
                    stepped = torch.empty(n, dtype=copy_dtype)
                    native.adamw_step_(master, m, v, grad, stepped, **hyper)
                    assert torch.equal(as_bits(peeked), as_bits(stepped)), (isa, grad_dtype, copy_dtype, decoupled)
                    assert not torch.equal(master, before[0])  # (the step did step)
    with pytest.raises(ValueError, match=r"^adamw_peek_: out_copy=None"):
        native.adamw_peek_(master, m, v, grad, None, **hyper)


@requires_native
def test_set_isa_reports_and_caps():
    best = _supported_isas()[-1]
    assert native.set_isa("scalar") == "scalar"
    assert native.backend() == "native-scalar"
    assert native.set_isa("avx512") == ("avx512" if best == "avx512" else best)
    assert native.set_isa(None) == best
    assert native.backend() == f"native-{best}"
    with pytest.raises(ValueError, match="isa='sse'"):
        native.set_isa("sse")


@requires_native
def test_bf16_copy_rounds_like_torch_including_specials():
    # every float class: random bit patterns (normals, subnormals, inf, NaN), plus exact ties
    gen = torch.Generator().manual_seed(7)
    n = 1 << 16
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**15, (4096,), generator=gen, dtype=torch.int32) << 16) | 0x8000
    specials = torch.tensor(
        [
            0x00000000,
            -(2**31),
            0x7F800000,
            0xFF800000 - 2**32,
            0x7FC00000,
            0x7F800001,
            0xFFC00000 - 2**32,
            0x7F7FFFFF,
            0x7F7F8000,
            0x00000001,
            0x00008000,
            0x00018000,
            0x3F808000,
            0x3F818000,
        ],
        dtype=torch.int64,
    ).to(torch.int32)
    master = torch.cat([bits, ties, specials]).view(torch.float32).clone()
    k = master.numel()
    m, v, grad = torch.zeros(k), torch.zeros(k), torch.zeros(k, dtype=torch.bfloat16)
    c16, c32 = torch.empty(k, dtype=torch.bfloat16), torch.empty(k)
    for isa in _supported_isas():
        native.set_isa(isa)
        for copy in (c16, c32):
            mm = master.clone()
            # lr=0 and zero grad/state: the update is -0, so master keeps its values (NaNs stay NaN)
            native.adamw_step_(
                mm,
                m.clone(),
                v.clone(),
                grad,
                copy,
                lr=0.0,
                beta1=BETA1,
                beta2=BETA2,
                eps=EPS,
                weight_decay=0.0,
                step=1,
            )
            want = mm.to(copy.dtype)
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(copy), nan), isa
            assert torch.equal(as_bits(copy)[~nan], as_bits(want)[~nan]), f"{isa} {copy.dtype}"
            if copy.dtype == torch.float32:
                assert torch.equal(as_bits(copy), as_bits(mm))


@requires_native
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["gf32", "gbf16"])
@pytest.mark.parametrize("n", [1, 7, 4096, BIG])
def test_grad_accumulate_equals_torch_sum(n, grad_dtype):
    gen = torch.Generator().manual_seed(n)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(4)]
    acc = torch.full((n,), float("nan"))
    for i, g in enumerate(grads):
        native.grad_accumulate_(acc, g, first=i == 0)
    want = grads[0].float()
    for g in grads[1:]:
        want = want + g.float()
    assert torch.equal(acc, want)


@requires_native
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 7, 4096, BIG])
def test_sq_norm(n, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = x.double().pow(2).sum().item()
    assert native.sq_norm(x) == pytest.approx(want, rel=1e-12, abs=0.0)
    if n:
        x[n // 2] = float("inf")
        assert native.sq_norm(x) == float("inf")
        x[n // 2] = float("nan")
        assert native.sq_norm(x) != native.sq_norm(x)


@requires_native
def test_zero_size_is_a_no_op():
    """Empty buffers, each an empty view inside a filled one: every kernel returns and writes nothing."""
    backing = {name: torch.full((8,), float(i + 1)) for i, name in enumerate(("master", "m", "v", "grad", "copy"))}
    before = {name: t.clone() for name, t in backing.items()}
    empty = {name: t[4:4] for name, t in backing.items()}
    native.adamw_step_(
        empty["master"],
        empty["m"],
        empty["v"],
        empty["grad"],
        empty["copy"],
        lr=LR,
        beta1=BETA1,
        beta2=BETA2,
        eps=EPS,
        weight_decay=0.1,
        step=1,
    )
    native.grad_accumulate_(empty["master"], empty["grad"], first=False)
    native.grad_accumulate_(empty["master"], empty["grad"], first=True)
    assert native.sq_norm(empty["grad"]) == 0.0
    assert all(torch.equal(as_bits(backing[name]), as_bits(before[name])) for name in backing)


@requires_native
def test_thread_setting_applies_to_calls_from_other_threads():
    native.set_num_threads(1)
    seen = []
    t = threading.Thread(target=lambda: seen.append(native.get_num_threads()))
    t.start()
    t.join()
    assert seen == [1]
    native.set_num_threads(None)
    with pytest.raises(ValueError, match="n=-1"):
        native.set_num_threads(-1)


# ---------------------------------------------------------------------------------------------------
# misuse


def _bufs(n=16, grad_dtype=torch.bfloat16, copy_dtype=torch.bfloat16):
    return dict(
        master=torch.zeros(n),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
        grad=torch.zeros(n, dtype=grad_dtype),
        out_copy=torch.empty(n, dtype=copy_dtype),
    )


def _step(**over):
    b = _bufs()
    b.update(over)
    kw = dict(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0, step=1)
    kw.update({k: b.pop(k) for k in list(b) if k in kw})
    native.adamw_step_(b["master"], b["exp_avg"], b["exp_avg_sq"], b["grad"], b["out_copy"], **kw)


@requires_native
@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(master=torch.zeros(16, dtype=torch.float64)), TypeError, r"master has dtype float64, expected float32"),
        (dict(exp_avg=torch.zeros(16, dtype=torch.bfloat16)), TypeError, r"exp_avg has dtype bfloat16"),
        (dict(exp_avg_sq=torch.zeros(16, dtype=torch.float16)), TypeError, r"exp_avg_sq has dtype float16"),
        (
            dict(grad=torch.zeros(16, dtype=torch.float16)),
            TypeError,
            r"grad has dtype float16, expected float32 or bfloat16",
        ),
        (dict(out_copy=torch.zeros(16, dtype=torch.float16)), TypeError, r"out_copy has dtype float16"),
        (dict(master=torch.zeros(32)[::2]), ValueError, r"master is not contiguous.*contiguous\(\)"),
        (dict(grad=torch.zeros(4, 8, dtype=torch.bfloat16).t()), ValueError, r"grad is not contiguous"),
        (dict(exp_avg=torch.zeros(17)), ValueError, r"exp_avg has 17 elements but master has 16"),
        (dict(out_copy=torch.zeros(15, dtype=torch.bfloat16)), ValueError, r"out_copy has 15 elements"),
        (dict(grad=torch.zeros(16, dtype=torch.bfloat16, device="meta")), ValueError, r"grad is on device meta.*CPU"),
        (dict(master=torch.zeros(16, device="meta")), ValueError, r"master is on device meta"),
        (dict(master=[0.0] * 16), TypeError, r"master must be a torch.Tensor, got list"),
        (dict(step=0), ValueError, r"step=0 must be an int >= 1"),
        (dict(step=1.0), ValueError, r"step=1.0 must be an int"),
        (dict(beta2=1.0), ValueError, r"beta2=1.0 must lie in \[0, 1\)"),
        (dict(lr="fast"), TypeError, r"lr='fast' must be a real number"),
    ],
)
def test_adamw_step_misuse_raises(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _step(**over)


@requires_native
def test_overlapping_buffers_raise():
    buf = torch.zeros(32)
    with pytest.raises(ValueError, match="overlaps"):
        _step(master=buf[:16], exp_avg=buf[8:24])


@requires_native
@pytest.mark.cuda
def test_cuda_tensor_raises():
    with pytest.raises(ValueError, match=r"grad is on device cuda"):
        _step(grad=torch.zeros(16, dtype=torch.bfloat16, device="cuda"))


@requires_native
def test_accumulate_and_norm_misuse_raise():
    with pytest.raises(TypeError, match="acc has dtype bfloat16"):
        native.grad_accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), first=True)
    with pytest.raises(ValueError, match="grad has 5 elements but acc has 4"):
        native.grad_accumulate_(torch.zeros(4), torch.zeros(5), first=True)
    with pytest.raises(ValueError, match="grad is not contiguous"):
        native.grad_accumulate_(torch.zeros(4), torch.zeros(8)[::2], first=False)
    with pytest.raises(ValueError, match="x is on device meta"):
        native.sq_norm(torch.zeros(4, device="meta"))
    with pytest.raises(TypeError, match="x has dtype int32"):
        native.sq_norm(torch.zeros(4, dtype=torch.int32))


def test_unavailable_library_warns_once_and_raises(monkeypatch):
    """When loading fails: one warning naming the fallback and the fix, available() False, calls raise."""

    def fail():
        raise ImportError("megatrain_lightning._adamw_native is not built (simulated)")

    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    monkeypatch.setattr(native, "_open_library", fail)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", None)
    with pytest.warns(RuntimeWarning, match=r"falls back to torch ops.*pip install -e \."):
        assert native.available() is False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.available() is False  # no second warning
        assert native.backend().startswith("torch (")
        assert "simulated" in native.load_error()
        with pytest.raises(RuntimeError, match="not available.*simulated"):
            native.adamw_step_(*_bufs().values(), lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0, step=1)
        with pytest.raises(RuntimeError, match="not available"):
            native.grad_accumulate_(torch.zeros(2), torch.zeros(2), first=True)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", None)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit opt-out does not warn
        assert native.available() is False
    assert "disabled by" in native.load_error()
