"""The cross-attention's caption-padding mask (``MHLAWanTransformer3DModel.set_text_padding_mask``).

The reference is independent of the mask: a masked model on a batch of captions padded with zero rows must give,
for each caption, what the unmasked model gives on that caption alone with its padding cut off (softmax over the
real tokens only), forward and backward. The premise (the pipeline pads with zero rows exactly after each
caption's tokens) is checked against the tokenizer's own token count.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pipelines.model import MHLAWanTransformer3DModel, PaddingMaskedCrossAttnProcessor, convert_self_attention
from pipelines.tiny import build_tiny_transformer

LENGTHS = (5, 2, 7)  # real tokens per caption; max_sequence_length 8
L = 8


def _model(gen, variant: str = "flash") -> MHLAWanTransformer3DModel:
    model = build_tiny_transformer(int(torch.randint(0, 2**31, (1,), generator=gen)), num_layers=2)
    if variant != "flash":
        convert_self_attention(model, variant)
    with torch.no_grad():  # off the initial values, so a weight the mask path skipped would show
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _batch(gen, text_dim: int):
    b = len(LENGTHS)
    x = torch.randn(b, 16, 2, 8, 8, generator=gen)
    t = torch.rand(b, generator=gen) * 1000
    text = torch.randn(b, L, text_dim, generator=gen)
    for i, n in enumerate(LENGTHS):
        text[i, n:] = 0.0  # the pipeline's padding
    return x, t, text


@pytest.mark.parametrize("variant", ["flash", "mhla"])
def test_masked_equals_each_caption_cut_to_its_tokens(gen, variant):
    model = _model(gen, variant)
    x, t, text = _batch(gen, model.config.text_dim)
    reference = copy.deepcopy(model)  # unmasked: diffusers' own cross-attention
    model.set_text_padding_mask(True)

    x1 = x.clone().requires_grad_(True)
    out = model(x1, t, text, return_dict=False)[0]
    weights = torch.randn(out.shape, generator=gen)
    (out * weights).sum().backward()

    grads_ref = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for i, n in enumerate(LENGTHS):
        xi = x[i : i + 1].clone().requires_grad_(True)
        ref = reference(xi, t[i : i + 1], text[i : i + 1, :n], return_dict=False)[0]
        torch.testing.assert_close(out[i : i + 1].detach(), ref.detach(), rtol=1e-5, atol=1e-5)
        reference.zero_grad()
        (ref * weights[i : i + 1]).sum().backward()
        torch.testing.assert_close(x1.grad[i : i + 1], xi.grad, rtol=1e-4, atol=1e-6)
        for name, p in reference.named_parameters():
            grads_ref[name] += p.grad
    own = dict(model.named_parameters())
    for name, g in grads_ref.items():
        torch.testing.assert_close(own[name].grad, g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=name)


def test_mask_changes_what_the_padding_did_and_nothing_else(gen):
    model = _model(gen)
    x, t, text = _batch(gen, model.config.text_dim)
    with torch.no_grad():
        plain = model(x, t, text, return_dict=False)[0]
        full = text.clone()
        full[full == 0] = 1.0  # no padding: every row a token
        plain_full = model(x, t, full, return_dict=False)[0]
        model.set_text_padding_mask(True)
        masked = model(x, t, text, return_dict=False)[0]
        masked_full = model(x, t, full, return_dict=False)[0]
        empty = model(x, t, torch.zeros_like(text), return_dict=False)[0]
        model.set_text_padding_mask(False)
        plain_empty = model(x, t, torch.zeros_like(text), return_dict=False)[0]
    assert (masked - plain).abs().max() > 1e-3  # the padding was read before
    torch.testing.assert_close(masked_full, plain_full)  # nothing to mask: the same
    torch.testing.assert_close(empty, plain_empty)  # no token at all: every row read, as unmasked
    assert model.attention_context.text_mask is None  # off: diffusers' way


def test_saved_model_keeps_the_mask_and_a_clone_has_its_own(gen, tmp_path):
    model = _model(gen, "mhla").set_text_padding_mask(True)
    x, t, text = _batch(gen, model.config.text_dim)
    with torch.no_grad():
        before = model(x, t, text, return_dict=False)[0]
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mask_text_padding"] is True
    loaded = MHLAWanTransformer3DModel.from_pretrained(tmp_path).eval()
    assert all(isinstance(b.attn2.processor, PaddingMaskedCrossAttnProcessor) for b in loaded.blocks)
    clone = model.clone()
    assert all(b.attn2.processor.context is clone.attention_context for b in clone.blocks)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t, text, return_dict=False)[0], before)
        clone(x[:1], t[:1], text[:1], return_dict=False)  # its own context: the original's mask is untouched
        assert model.attention_context.text_mask.shape[0] == len(LENGTHS)
        torch.testing.assert_close(clone(x, t, text, return_dict=False)[0], before)


def test_refused_for_an_image_to_video_transformer():
    model = build_tiny_transformer(0, num_layers=1, added_kv_proj_dim=32, image_dim=32)
    with pytest.raises(ValueError, match=r"added_kv_proj_dim=32.*text-to-video"):
        model.set_text_padding_mask(True)
    assert not model.config.mask_text_padding


def test_the_pipeline_pads_each_caption_with_zero_rows_after_its_tokens(tiny_components):
    from training.encoding import Encoder

    captions = ["a red square", "x", "", "a blue circle moves to the left on grey"]
    text = Encoder(tiny_components, 16).text(captions)
    from pipelines.model import text_padding_mask

    kept = text_padding_mask(text)[:, 0, 0, :]
    tokens = [min(len(tiny_components.tokenizer(c).input_ids), 16) for c in captions]  # with the end token
    for i, n in enumerate(tokens):
        assert kept[i].tolist() == [True] * n + [False] * (16 - n), captions[i]
