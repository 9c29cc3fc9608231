import pytest
import torch

from mhla import SOFTMAX_BACKENDS, last_softmax_backend, softmax_attention, softmax_attention_dense
from mhla.softmax import installed_external_backends


def draw(gen, shape, dtype=torch.float64):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "sdpa_math", "sdpa_flash"])
def test_softmax_matches_dense_and_names_backend(gen, backend):
    q, k, v = (draw(gen, (2, 77, 3, 16)) for _ in range(3))
    out = softmax_attention(q, k, v, backend=backend)
    ref = softmax_attention_dense(q, k, v)
    assert out.shape == q.shape
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-10
    ran = last_softmax_backend()
    assert ran in SOFTMAX_BACKENDS and ran != "auto"
    if backend != "auto":
        assert ran == backend


def test_softmax_float32_and_scale(gen):
    q, k, v = (draw(gen, (1, 50, 2, 8)) for _ in range(3))
    ref = softmax_attention_dense(q, k, v)
    out32 = softmax_attention(q.float(), k.float(), v.float())
    assert float((out32 - ref).abs().max() / ref.abs().max()) < 1e-5
    scale = 0.3
    out = softmax_attention(q, k, v, scale=scale)
    torch.testing.assert_close(out, softmax_attention_dense(q, k, v, scale=scale))


@pytest.mark.slow  # numerical gradient check
def test_softmax_gradcheck(gen):
    q, k, v = (draw(gen, (1, 50, 2, 8)) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda q, k, v: softmax_attention(q, k, v, backend="sdpa_math"), leaves)


def test_softmax_bad_input():
    q = torch.randn(1, 10, 2, 8)
    with pytest.raises(ValueError, match="unknown softmax backend 'cuda_magic'"):
        softmax_attention(q, q, q, backend="cuda_magic")
    with pytest.raises(ValueError, match="q, k shaped"):
        softmax_attention(q, q[:, :5], q)
    missing = [b for b in ("flash_attn", "flash_attn_3", "xformers") if b not in installed_external_backends()]
    if missing:
        with pytest.raises(ValueError, match="not installed"):
            softmax_attention(q, q, q, backend=missing[0])


@pytest.mark.gpu
def test_softmax_gpu_backends_match_reference(gen):
    q, k, v = (draw(gen, (1, 1024, 4, 64)) for _ in range(3))
    ref = softmax_attention_dense(q, k, v)
    for dtype in (torch.bfloat16, torch.float16):
        qc, kc, vc = (t.to("cuda", dtype) for t in (q, k, v))
        out = softmax_attention(qc, kc, vc)
        assert last_softmax_backend() in SOFTMAX_BACKENDS
        assert float((out.double().cpu() - ref).abs().max() / ref.abs().max()) < 2e-2
