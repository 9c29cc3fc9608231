"""The fused operator's fixed cost per call, counted under Triton's interpreter (no timing): kernel launches,
host synchronisations and host Python work per call; and the device constants it keeps between calls
(the mixing product's operands, the MHLA module's constrained matrix) made again whenever their source
changes, checked against the dense formula on fresh random inputs, forward and backward."""

import pytest
import torch

from mhla import MHLA, BlockLayout, locality_init, mhla_attention, mhla_attention_dense

triton_ops = pytest.importorskip("mhla.triton_ops")
if not triton_ops.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from benchmarks.launch_count import cases, count_call  # noqa: E402


def rel_err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())


@pytest.mark.parametrize("case", ["operator, fixed mixing", "layer in inference (MHLA module's mixing)", "linear"])
def test_launches_and_host_work_per_call(case):
    counted = count_call(cases()[case])
    assert counted["triton"] == ["summaries", "output"]
    assert counted["syncs"] == {}  # nothing waits for the GPU
    if case == "linear":
        assert counted["torch"] == {"sum": 1}  # the chunks' summaries summed once
    else:
        # the mixing: two bf16 products (hi and lo parts of the float32 coefficients), nothing else; before
        # this issue 7 (operator) and 14 (layer) torch launches: the coefficients' copies and splits, and
        # the module's constraint, on every call
        assert counted["torch"] == {"bmm": 1, "baddbmm": 1}
    assert counted["launches"] <= 4
    assert counted["python_calls"] < 150  # measured 75-95 (a guard against per-call host work creeping in)


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
