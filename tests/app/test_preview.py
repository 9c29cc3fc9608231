"""Issue 52 (3): live previews. The latent-to-colour map's fit against independent references (a loop over patches,
the normal equations, a VAE that is linear by construction, a trivial baseline on held-out latents), the denoised
estimate against the scheduler's own formula, and the previews a run makes, when, and what they cost it."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app import compare, preview

SMALLEST = compare.preset_key(compare.PRESETS[0])


def _patch_means_loop(videos: np.ndarray, stride, latent_shape) -> np.ndarray:
    """The reference: for each latent pixel, the mean of its video pixels, by loops (frame 0 alone, then groups)."""
    st, sh, sw = stride
    frames, h, w = latent_shape
    out = np.zeros((videos.shape[0], frames, h, w, 3))
    for b in range(videos.shape[0]):
        for f in range(frames):
            ts = [0] if f == 0 else list(range((f - 1) * st + 1, f * st + 1))
            for i in range(h):
                for j in range(w):
                    patch = videos[b, :, ts, i * sh : (i + 1) * sh, j * sw : (j + 1) * sw]
                    out[b, f, i, j] = (
                        patch.reshape(3, -1).mean(axis=1) if patch.shape[0] == 3 else patch.mean((0, 2, 3))
                    )
    return out


def test_patch_means_are_the_pixels_each_latent_stands_for():
    videos = torch.rand(2, 3, 9, 12, 20)  # 9 frames at temporal stride 4: latents of 3 frames
    got = preview.patch_means(videos, (4, 4, 4), (3, 3, 5)).numpy()
    np.testing.assert_allclose(got, _patch_means_loop(videos.numpy(), (4, 4, 4), (3, 3, 5)), atol=1e-6)
    with pytest.raises(ValueError, match="too small"):
        preview.patch_means(videos, (4, 4, 4), (4, 3, 5))


class LinearVAE:
    """A VAE whose decoder is linear by construction: each latent pixel's patch is ``A z + b`` (flat, every frame
    of its group), so the least-squares map must be ``(A, b)`` exactly."""

    def __init__(self, channels: int, stride=(4, 8, 8), seed=0):
        g = torch.Generator().manual_seed(seed)
        self.A = torch.rand(3, channels, generator=g) * 0.2 - 0.1
        self.b = torch.tensor([0.2, 0.5, 0.7])
        self.stride = stride

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        st, sh, sw = self.stride
        rgb = torch.einsum("oc,bcfhw->bofhw", self.A, z) + self.b.view(1, 3, 1, 1, 1)
        first, rest = rgb[:, :, :1], rgb[:, :, 1:].repeat_interleave(st, dim=2)
        return torch.cat([first, rest], dim=2).repeat_interleave(sh, dim=3).repeat_interleave(sw, dim=4)


def test_the_fit_recovers_a_linear_vae_exactly():
    vae = LinearVAE(16)
    z = torch.randn(3, 16, 3, 4, 5)
    fitted = preview.fit_latent_map(z, vae.decode(z), vae.stride)
    torch.testing.assert_close(fitted.weight, vae.A, atol=1e-5, rtol=0)
    torch.testing.assert_close(fitted.bias, vae.b, atol=1e-5, rtol=0)


def test_the_fit_is_the_normal_equations_solution_on_a_nonlinear_vae():
    vae = LinearVAE(8, stride=(2, 4, 4))
    z = torch.randn(4, 8, 3, 3, 4)
    videos = torch.sigmoid(4 * (vae.decode(z) - 0.5)) + 0.05 * vae.decode(z**2)  # not linear in z
    fitted = preview.fit_latent_map(z, videos, vae.stride)
    # the reference: (X^T X) w = X^T y in float64 numpy, X the latent pixels with a ones column
    x = z.permute(0, 2, 3, 4, 1).reshape(-1, 8).double().numpy()
    y = _patch_means_loop(videos.double().numpy(), vae.stride, (3, 3, 4)).reshape(-1, 3)
    design = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    solution = np.linalg.solve(design.T @ design, design.T @ y)
    np.testing.assert_allclose(fitted.weight.numpy(), solution[:8].T, atol=1e-4)
    np.testing.assert_allclose(fitted.bias.numpy(), solution[8], atol=1e-4)


def _components(vae, stride=(2, 4, 4)):
    return SimpleNamespace(vae=vae, vae_stride=stride, defaults={"height": 64, "width": 80})


@pytest.mark.slow  # the built-in model's VAE encodes and decodes 24 small clips, twice
def test_on_the_built_in_vae_the_map_beats_the_mean_colour_on_held_out_clips():
    from diffusers import AutoencoderKLWan

    from pipelines.model_dir import BUILTIN_DIR, builtin_available

    if not builtin_available():
        pytest.skip("the built-in model is not here")
    vae = AutoencoderKLWan.from_pretrained(BUILTIN_DIR / "vae").eval()
    c = _components(vae)
    from world.synthetic import sample_clips

    fitted = preview.fit_for(c, sample_clips, seed=0)
    with torch.no_grad():
        held = preview.fitting_latents(c, sample_clips, clips=8, seed=1)  # other clips of the world
        videos = preview.vae_decode(c, held)
    target = preview.patch_means(videos, c.vae_stride, tuple(held.shape[2:]))
    predicted = torch.stack([fitted.rgb(z) for z in held])
    error = ((predicted - target) ** 2).mean()
    baseline = ((target - target.mean(dim=(0, 1, 2, 3))) ** 2).mean()  # the held-out clips' own mean colour
    assert error < 0.5 * baseline, (float(error), float(baseline))


def test_the_denoised_estimate_is_the_scheduler_s_x0():
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    s = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    s.set_timesteps(10)
    sample, velocity = torch.randn(1, 4, 2, 3, 3), torch.randn(1, 4, 2, 3, 3)
    sigma = s.sigmas[0]
    after = s.step(velocity, s.timesteps[0], sample).prev_sample
    got, is_estimate = preview.denoised(after, s)
    assert is_estimate and torch.allclose(got, sample - sigma * velocity, atol=1e-6)  # flow matching's x0
    euler = FlowMatchEulerDiscreteScheduler()
    assert preview.denoised(after, euler) == (after, False)  # keeps no estimate: the latents themselves


def test_previews_come_every_k_steps_but_the_last_sized_to_a_column():
    vae = LinearVAE(16)
    fitted = preview.fit_latent_map(z := torch.randn(2, 16, 3, 4, 5), vae.decode(z), vae.stride)
    models = SimpleNamespace(components=SimpleNamespace(vae=torch.nn.Identity()))
    preview._MAPS[models.components.vae] = (fitted, 0.0)
    shown, spent = [], []
    hook = preview.make_previewer(models, 480, 832, 4, 10, lambda k, f, e: shown.append((k, f.shape, e)), spent)
    for i in range(10):
        hook(i, torch.randn(1, 16, 3, 60, 104), None)
    assert [k for k, _, _ in shown] == [4, 8] and len(spent) == 2  # not at 10: the video follows
    assert shown[0][1] == (round(480 * 320 / 832), 320, 3) and shown[0][2] is False  # no scheduler: the latents
    assert preview.make_previewer(models, 64, 80, 0, 10, lambda *a: None) is None


def test_a_failing_preview_never_stops_the_run(caplog):
    models = SimpleNamespace(components=SimpleNamespace(vae=torch.nn.Identity()))
    preview._MAPS[models.components.vae] = (preview.LatentMap(torch.zeros(3, 16), torch.zeros(3)), 0.0)
    shown = []
    hook = preview.make_previewer(models, 64, 80, 1, 10, lambda *a: shown.append(a))
    hook(0, torch.randn(1, 48, 3, 8, 10), None)  # 48 channels for a 16-channel map: refused, logged
    hook(1, torch.randn(1, 16, 3, 8, 10), None)  # no more previews in this run
    assert shown == [] and "live preview failed" in caplog.text


def test_the_preview_html_is_a_labelled_jpeg():
    frame = np.zeros((40, 64, 3), np.uint8)
    frame[:, 32:] = (200, 30, 30)
    html = preview.preview_html(frame, "mhla", 8, 20)
    assert "preview, step 8/20" in html and 'data-step="8"' in html and "denoised estimate" in html
    data = html.split("base64,")[1].split('"')[0]
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
    assert image.shape == (40, 64, 3) and abs(int(image[20, 50, 0]) - 200) < 12 and image[20, 10].max() < 12


@pytest.fixture(scope="module")
def tiny():
    from app.models import load_app_models

    return load_app_models("tiny-random")


@pytest.mark.slow  # two variants of the tiny model, five steps each
def test_a_run_previews_each_variant_before_its_video_outside_its_timed_steps(tiny, tmp_path):
    req = compare.check_request(tiny, "a fox", "", 0, 5, 5.0, SMALLEST, ["flash", "mhla"], compare.CPU_MAX_TOKENS, 1)
    events = []
    results = list(
        compare.iter_compare(
            tiny,
            req,
            tmp_path,
            preview_every=2,
            show_preview=lambda name, k, n, frame, estimate: events.append((name, k, n, frame.shape, estimate)),
        )
    )
    order = [("flash", 2), ("mhla", 2), ("flash", 4), ("mhla", 4)]  # in turns; else one variant after the other
    assert [(n, k) for n, k, *_ in events] == (order if compare.interleaves(tiny, req.variants) else sorted(order))
    assert all(n == 5 and shape == (req.height, req.width, 3) and estimate for *_, n, shape, estimate in events)
    final = results[-1]
    assert {v: len(s) for v, s in final.preview_seconds.items()} == {"flash": 2, "mhla": 2}
    for run in final.runs:  # the steps as the clock timed them: a preview's time is in none of them
        assert len(run.timing.steps) == 5 and run.video is not None
    assert max(s for v in final.preview_seconds.values() for s in v) < 1.0
