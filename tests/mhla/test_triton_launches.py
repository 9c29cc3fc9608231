"""The fused operator's fixed cost per call, counted under Triton's interpreter (no timing): kernel launches,
host synchronisations and host Python work per call (with Triton's launcher, and with the direct launches of
kept compiled kernels a GPU takes from the second call on); the two ways the summaries are mixed (inside the
output and backward kernels for small M, one mixing kernel otherwise) and the direct launches, checked against
the plain reference (mhla/naive.py) forward and backward on fresh random inputs; and the device constants kept
between calls (the mixing product's operands, the MHLA module's constrained matrix) made again whenever their
source changes."""

import warnings

import pytest
import torch

from mhla import MHLA, BlockLayout, locality_init, mhla_attention, mhla_attention_dense
from mhla.naive import linear_attention_naive, mhla_attention_naive

triton_ops = pytest.importorskip("mhla.triton_ops")
if not triton_ops.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from benchmarks.launch_count import cases, count_call, stub_kernels  # noqa: E402


def rel_err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())


CASES = ["operator, fixed mixing", "layer in inference (MHLA module's mixing)", "linear"]


@pytest.mark.parametrize("case", CASES)
def test_launches_and_host_work_per_call(case):
    counted = count_call(cases()[case])
    # 4 blocks: the output kernel mixes the summaries itself; before issue 50 the mixing was two torch products
    # (bmm, baddbmm; linear attention: a sum), and before issue 40 7-14 torch launches
    assert counted["triton"] == ["summaries", "output"]
    assert counted["torch"] == {}
    assert counted["syncs"] == {}  # nothing waits for the GPU
    assert counted["launches"] == 2
    # measured 24-41 (75-95 before issue 50: the autograd node under no_grad, the per-call shape work, the
    # checks made twice, the linear layout parsed per call); a guard against per-call host work creeping in
    assert counted["python_calls"] <= 50
    # the direct launches (GPU, from the second call): both kernels, none through Triton's launcher, and a few
    # calls more than with the launches intercepted (the stubbed launcher's own 2)
    assert counted["direct_launches"] == 2 and counted["jit_launches"] == 0
    assert counted["python_calls_direct"] <= counted["python_calls"] + 8


@pytest.mark.slow
def test_large_layouts_mix_in_one_kernel(monkeypatch):
    # past the in-kernel mixing's budget the summaries are mixed by one kernel (bf16: the float32 coefficients'
    # hi + lo products in one accumulator), not the two torch products before: 3 launches, no torch launch
    monkeypatch.setattr(triton_ops, "MIX_IN_KERNEL_BYTES", 0)
    counted = count_call(cases()["operator, fixed mixing"])
    assert counted["triton"] == ["summaries", "mixing", "output"]
    assert counted["torch"] == {} and counted["syncs"] == {}
    assert counted["direct_launches"] == 3 and counted["jit_launches"] == 0


@pytest.mark.slow
def test_backward_launches(monkeypatch):
    # forward + backward with a fixed mixing: 2 + 2 kernels when the kernels mix (before: 4 + 7 launches, the
    # mixing recomputed and mixed back by torch products); 3 + 4 with the mixing kernel
    layout = BlockLayout((2, 4, 4), (1, 2, 2))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, layout.num_tokens, 2, 16, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    mixing = locality_init(layout).float()

    def step():
        for t in (q, k, v):
            t.grad = None  # written, not accumulated into
        out = mhla_attention(q, k, v, layout, mixing, normalize=False, impl="triton")
        out.float().sum().backward()

    for budget, kernels in ((triton_ops.MIX_IN_KERNEL_BYTES, 4), (0, 7)):
        monkeypatch.setattr(triton_ops, "MIX_IN_KERNEL_BYTES", budget)
        counted = count_call(step)
        assert counted["syncs"] == {}
        assert counted["direct_launches"] == kernels, (budget, counted)
        torch_ops = {op: n for op, n in counted["torch"].items() if op not in ("sum", "_to_copy", "ones_like")}
        assert torch_ops == {}, torch_ops  # the loss's own sum and cast are the test's, not the operator's


def random_case(gen, grid, blocks, b, h, d, e, per_head):
    layout = BlockLayout(grid, blocks)
    n, m_blocks = layout.num_tokens, layout.num_blocks
    q, k = (torch.randn(b, n, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, n, h, e, generator=gen, dtype=torch.float64)
    m = torch.rand((h, m_blocks, m_blocks) if per_head else (m_blocks, m_blocks), generator=gen, dtype=torch.float64)
    angles = (torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64) * 6.28).repeat_interleave(2, -1)
    return layout, (q, k, v, m + 0.01), (angles.cos(), angles.sin())


# (grid, blocks, batch, heads, head dim, value dim, per-head mixing, normalizer): ragged last blocks (3x5x7 into
# 2x2x3; 5x9 into 2x4), one block, per-head mixing, a value width that is not a power of two
SHAPES = [
    ((3, 5, 7), (2, 2, 3), 2, 2, 16, 8, False, False),
    ((2, 5, 9), (1, 2, 4), 1, 3, 16, 24, True, True),
    ((1, 4, 6), (1, 1, 1), 2, 1, 8, 8, False, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["in the kernels", "mixing kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixing_paths_match_the_naive_reference(gen, monkeypatch, mix, dtype):
    monkeypatch.setattr(triton_ops, "MIX_IN_KERNEL_BYTES", 2**40 if mix == "in the kernels" else 0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for *shape, normalize in SHAPES:
        layout, (q, k, v, m), rope = random_case(gen, *shape)
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [m.float().requires_grad_()]
        rope32 = tuple(t.float() for t in rope)
        out = mhla_attention(*leaves[:3], layout, leaves[3], normalize=normalize, rotary_emb=rope32, impl="triton")
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, m)]
        ref = mhla_attention_naive(*ref_leaves[:3], layout, ref_leaves[3], normalize=normalize, rotary_emb=rope)
        up = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out.double() * up).sum().backward()
        (ref * up).sum().backward()
        assert rel_err(out, ref) < tol, (shape, normalize)
        for name, a, b in zip(("q", "k", "v", "mixing"), leaves, ref_leaves):
            if name == "mixing" and layout.num_blocks == 1 and dtype == torch.bfloat16:
                # one coefficient: its gradient is ONE sum of terms of both signs that mostly cancel, which the
                # rounding of q, k, v to bf16 (the reference gets them unrounded) moves by more than 3e-2 of it
                continue
            assert rel_err(a.grad, b.grad) < tol, (shape, normalize, name)
        with torch.no_grad():  # inference: no autograd node, the same numbers
            again = mhla_attention(
                *leaves[:3], layout, leaves[3], normalize=normalize, rotary_emb=rope32, impl="triton"
            )
        assert again.grad_fn is None and torch.equal(again, out.detach())


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["in the kernels", "summed by torch"])
def test_linear_attention_paths_match_the_naive_reference(gen, monkeypatch, mix):
    monkeypatch.setattr(triton_ops, "MIX_IN_KERNEL_BYTES", 2**40 if mix == "in the kernels" else 0)
    n = 700  # 2 chunks of 350
    q, k = (torch.randn(2, n, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, n, 2, 8, generator=gen, dtype=torch.float64)
    for normalize in (False, True):
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        out = triton_ops.linear_attention_fused(*leaves, normalize=normalize)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = linear_attention_naive(*ref_leaves, "relu", normalize, None, 1e-6, None)
        up = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out.double() * up).sum().backward()
        (ref * up).sum().backward()
        assert rel_err(out, ref) < 1e-4
        for a, b in zip(leaves, ref_leaves):
            assert rel_err(a.grad, b.grad) < 1e-4


@pytest.mark.slow
def test_direct_launches_bind_arguments_in_the_kernels_order(gen, monkeypatch):
    # a GPU launch returns the compiled kernel, launched directly from the second call on with every argument
    # in the kernel's order; here stand-ins run the interpreted kernel with those arguments bound BY NAME, so
    # an argument out of place gives wrong numbers
    layout, (q, k, v, m), rope = random_case(gen, (3, 5, 7), (2, 2, 3), 1, 2, 16, 8, False)
    rope32 = tuple(t.float() for t in rope)
    for budget in (2**40, 0):  # the kernels mix; the mixing kernel
        monkeypatch.setattr(triton_ops, "MIX_IN_KERNEL_BYTES", budget)
        with stub_kernels(run_by_name=True) as stubs:
            for call in range(2):
                leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]  # bf16: the mixing kernel runs
                out = mhla_attention(*leaves, layout, m.float(), normalize=True, rotary_emb=rope32, impl="triton")
                out.float().sum().backward()
                ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = mhla_attention_naive(*ref_leaves, layout, m, normalize=True, rotary_emb=rope)
                ref.backward(torch.ones_like(ref))
                assert rel_err(out, ref) < 3e-2, (budget, call)  # a misplaced argument: errors of order 1
                for a, b in zip(leaves, ref_leaves):
                    assert rel_err(a.grad, b.grad) < 3e-2, (budget, call)
                direct = {name: s.compiled.launches for name, s in stubs.items()}
                # the first call goes through Triton's launcher (and keeps the kernel), the second does not; the
                # mixing kernel runs only past the in-kernel budget, three times a call (forward, again in the
                # backward, transposed), the second of them already direct in the first call (counts add up)
                expected = dict.fromkeys(stubs, call) | {"mixing": 0 if budget else 1 + 3 * call}
                assert direct == expected, (budget, direct)
            # a view whose start is not 16-byte aligned is another specialisation: through the launcher again
            wide = torch.randn(1, layout.num_tokens, 2, 17, generator=gen)[..., 1:]
            before = stubs["summaries"].jit_launches
            triton_ops.mhla_attention_fused(wide, wide, v.float(), layout, m.float(), normalize=False)
            assert stubs["summaries"].jit_launches == before + 1


def test_a_refused_direct_launch_turns_them_off(gen, monkeypatch):
    layout, (q, k, v, m), _ = random_case(gen, (2, 4, 4), (1, 2, 2), 1, 2, 16, 8, False)
    args = [t.float() for t in (q, k, v)]
    with stub_kernels(run_by_name=True) as stubs:
        first = triton_ops.mhla_attention_fused(*args, layout, m.float(), normalize=False)

        def refuse(grid):
            raise TypeError("launcher takes 12 arguments")

        for stub in stubs.values():
            monkeypatch.setattr(stub.compiled, "__class__", type("Refusing", (type(stub.compiled),), {}))
            monkeypatch.setattr(type(stub.compiled), "__getitem__", lambda self, grid: refuse(grid))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = triton_ops.mhla_attention_fused(*args, layout, m.float(), normalize=False)
        assert not triton_ops.DIRECT_LAUNCH and "direct kernel launches turned off" in str(caught[0].message)
        assert torch.equal(again, first)
    assert triton_ops.DIRECT_LAUNCH  # the context put the setting back


def test_geometry_is_made_once_per_shape_and_strides(gen):
    layout = BlockLayout((2, 4, 4), (1, 2, 2))
    q = torch.randn(1, layout.num_tokens, 2, 16, generator=gen)
    g = triton_ops._geometry(q, q, q, layout, None, "v2")
    assert triton_ops._geometry(q.clone(), q, q, layout, None, "v2") is g  # same shapes and strides
    view = torch.randn(1, layout.num_tokens, 2, 32, generator=gen)[..., :16]
    assert triton_ops._geometry(view, q, q, layout, None, "v2") is not g  # other strides
    assert triton_ops._geometry(q, q, q, layout, None, "v1") is not g


def fresh(gen, layout, h=2, d=16, dtype=torch.float32):
    n = layout.num_tokens
    q, k, v = (torch.randn(1, n, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    angles = (torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64) * 6.28).repeat_interleave(2, -1)
    return (q, k, v), (angles.cos(), angles.sin())


def test_cached_mixing_operands_follow_in_place_changes(gen):
    layout = BlockLayout((2, 4, 4), (1, 2, 2))
    (q, k, v), rope = fresh(gen, layout)
    mixing = locality_init(layout).float()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        args = [t.to(dtype) for t in (q, k, v)]
        rope32 = tuple(t.float() for t in rope)
        for _ in range(2):  # the second call reuses the operands
            out = mhla_attention(*args, layout, mixing, normalize=False, rotary_emb=rope32, impl="triton")
            ref = mhla_attention_dense(q, k, v, layout, mixing.double(), normalize=False, rotary_emb=rope)
            assert rel_err(out, ref) < tol
        with torch.no_grad():
            mixing.mul_(torch.rand(mixing.shape, generator=gen))  # in place: its version changes
        out = mhla_attention(*args, layout, mixing, normalize=False, rotary_emb=rope32, impl="triton")
        ref = mhla_attention_dense(q, k, v, layout, mixing.double(), normalize=False, rotary_emb=rope)
        assert rel_err(out, ref) < tol


def test_gradients_with_a_learnable_mixing_are_not_cached(gen):
    layout = BlockLayout((2, 4, 4), (1, 2, 2))
    (q, k, v), rope = fresh(gen, layout)
    for _ in range(2):
        mixing = torch.rand(layout.num_blocks, layout.num_blocks, generator=gen, dtype=torch.float64)
        leaves = [t.float().requires_grad_() for t in (q, k, v, mixing)]
        out = mhla_attention(*leaves[:3], layout, leaves[3], rotary_emb=tuple(t.float() for t in rope), impl="triton")
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
        ref = mhla_attention_dense(*ref_leaves[:3], layout, ref_leaves[3], rotary_emb=rope)
        up = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out.double() * up).sum().backward()
        (ref * up).sum().backward()
        assert rel_err(out, ref) < 1e-4
        for a, b in zip(leaves, ref_leaves):
            assert rel_err(a.grad, b.grad) < 1e-4


def test_module_mixing_is_reused_in_a_scope_only():
    from mhla.mixing import reuse_constrained_mixing

    module = MHLA(blocks=(1, 2, 2))
    with torch.no_grad():
        assert module.mixing() is not module.mixing()  # outside a scope: computed on every call
        with reuse_constrained_mixing():
            first, again = module.mixing(), module.mixing()
            assert first is again
            module.mixing.weight.mul_(0.5)  # in place (as an optimiser or load_state_dict): made again
            changed = module.mixing()
            assert changed is not first
            torch.testing.assert_close(changed, module.mixing._compute(module.mixing.weight).detach())
        module.mixing.weight.data.mul_(3.0)  # through .data (no version change): a new scope sees it
        module.mixing.weight.data[0, 0] = 7.0
        with reuse_constrained_mixing():
            fresh_value = module.mixing()
            assert fresh_value is not changed
            torch.testing.assert_close(fresh_value, module.mixing._compute(module.mixing.weight).detach())
    with reuse_constrained_mixing():
        with_grad = module.mixing()  # grad enabled on a learnable weight: computed, differentiable
    assert with_grad.requires_grad
