"""Training the Wan2.1 VAE (``AutoencoderKLWan``) to reconstruct videos (configs with ``task: vae``).

    python -m training.vae --config factory/configs/vae.yaml
    python -m training.finetune --config factory/configs/vae.yaml   # the same: finetune.py hands task: vae on

The VAE of ``model.path`` is trained on random ``vae.crop`` x ``vae.crop`` crops of the configured
clips (it is fully convolutional and causal in time, so it then encodes whole, longer clips): L1 + MSE
reconstruction of the posterior mean, objects weighted up (``vae.object_weight``), plus
``vae.kl_weight`` times the KL term; AdamW, warm-up then constant rate. ``train.precision: bf16``
runs the forward and backward passes under bfloat16 autocast (master weights and optimizer stay float32):
on this project's CPU (AVX512-BF16) a step takes 0.84x the float32 time at base_dim 12 and 0.69x at 24
(``python -m factory.vae_speed`` measures it); ``no`` keeps float32 throughout (the shipped VAE's recipe).
Checkpoints (``checkpoints/step-XXXXXXX/vae/`` + optimizer and generator state) are atomic and
``resume=latest`` continues a killed run. At the end it measures the per-channel mean and std of the
latents (posterior means of ``vae.stats_samples`` full-size clips), writes them into the VAE's config
as ``latents_mean`` / ``latents_std`` (what WanPipeline normalises latents with) and, with
``vae.export`` set, installs the VAE there (e.g. the model directory's ``vae/``) atomically, with a
``trained.json`` recording this run and the runs before it.

``vae.trainable: decoder`` trains the decoder (and ``post_quant_conv``) only: the encoder, hence the
latents and their statistics, stay bit for bit, so a transformer already trained on those latents
keeps working and only gets sharper videos (the built-in model's ``vae-decoder`` stage).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from common.outputs import replace_dir, write_text_atomic
from training import checkpoint as ckpt
from training.config import FinetuneConfig, config_yaml, lr_multiplier
from training.data import ResumableSampler


def _random_crop(video: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """``(B, 3, T, H, W)`` -> ``(B, 3, T, size, size)``, one crop position per clip."""
    b, _, _, h, w = video.shape
    if size <= 0 or (size >= h and size >= w):
        return video
    size_h, size_w = min(size, h), min(size, w)
    out = []
    for i in range(b):
        top = int(torch.randint(0, h - size_h + 1, (1,), generator=generator))
        left = int(torch.randint(0, w - size_w + 1, (1,), generator=generator))
        out.append(video[i, :, :, top : top + size_h, left : left + size_w])
    return torch.stack(out)


def decode_unclamped(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLWan.decode`` without its final clamp to [-1, 1], which would stop the gradient of
    every saturated pixel (most of them at initialisation). Same causal frame-by-frame loop."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    out = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        out.append(
            vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        )
    vae.clear_cache()
    return torch.cat(out, 2)


def freeze_encoder(vae: Any) -> None:
    """``vae.trainable: decoder``: the encoder and ``quant_conv`` take no gradient (the encoder runs in eval
    mode), so the latents, and a transformer trained on them, stay valid."""
    vae.encoder.requires_grad_(False).eval()
    vae.quant_conv.requires_grad_(False)


def autocast_for(precision: str, device_type: str = "cpu") -> torch.autocast:
    """The autocast context of ``train.precision`` for the VAE task: ``no`` -> float32, ``bf16`` ->
    bfloat16 autocast. ``fp16`` needs a gradient scaler this loop does not have: refused."""
    if precision == "no":
        return torch.autocast(device_type, enabled=False)
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    raise ValueError(f"train.precision={precision!r} is not supported for task=vae; expected 'no' or 'bf16'")


def vae_loss(
    vae: Any,
    video: torch.Tensor,
    kl_weight: float,
    object_weight: float,
    train_encoder: bool = True,
    latent_noise: float = 0.0,
    generator: torch.Generator | None = None,
    edge_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(loss, reconstruction L1)`` of one batch ``(B, 3, T, H, W)`` in [-1, 1].

    Reconstruction of the posterior mean, squared and absolute error, with saturated pixels (the objects:
    a few per cent of a frame on grey-toned backgrounds) weighted ``1 + object_weight``; plus ``kl_weight``
    times the mean KL per element. ``latent_noise`` > 0 decodes the posterior mean plus Gaussian noise of that
    many standard deviations of each latent channel (measured over the batch, not differentiated): the decoder
    learns to decode latents that are near, not at, the encoder's (what a transformer generates).
    ``edge_weight`` > 0 adds that many times the weighted L1 of the horizontal and vertical differences of
    neighbouring pixels (recon's against the video's): sharp corners and edges, which a shape is read by.
    With ``train_encoder=False`` the encoder runs without a graph (the KL term is then a constant).
    """
    with torch.set_grad_enabled(train_encoder and torch.is_grad_enabled()):
        posterior = vae.encode(video).latent_dist
    z = posterior.mean
    if latent_noise > 0:
        std = z.detach().float().transpose(0, 1).reshape(z.shape[1], -1).std(1).view(1, -1, 1, 1, 1)
        noise = torch.randn(z.shape, generator=generator, dtype=torch.float32).to(z.device)
        z = z + latent_noise * std.to(z.dtype) * noise.to(z.dtype)
    recon = decode_unclamped(vae, z)
    saturated = (video.amax(1, keepdim=True) - video.amin(1, keepdim=True)) > 0.5
    weight = 1.0 + object_weight * saturated.float()
    err = recon - video
    loss = (weight * (err.abs() + err.square())).mean()
    if edge_weight > 0:  # err's own differences are recon's minus the video's
        dx = (err[..., :, 1:] - err[..., :, :-1]).abs() * torch.maximum(weight[..., :, 1:], weight[..., :, :-1])
        dy = (err[..., 1:, :] - err[..., :-1, :]).abs() * torch.maximum(weight[..., 1:, :], weight[..., :-1, :])
        loss = loss + edge_weight * (dx.mean() + dy.mean())
    loss = loss + kl_weight * posterior.kl().mean() / math.prod(video.shape[1:])
    return loss, err.abs().mean().detach()


@torch.no_grad()
def latent_statistics(vae: Any, dataset: Any, num: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of posterior means over the first ``num`` clips of ``dataset``."""
    zs = []
    for i in tqdm(range(min(num, len(dataset))), desc="latent statistics", leave=False):
        z = vae.encode(dataset[i]["video"][None]).latent_dist.mean  # (1, C, F, h, w)
        zs.append(z.transpose(0, 1).reshape(z.shape[1], -1))
    z = torch.cat(zs, dim=1)
    return [round(v, 5) for v in z.mean(1).tolist()], [round(max(v, 1e-3), 5) for v in z.std(1).tolist()]


def train_vae(cfg: FinetuneConfig) -> int:
    from diffusers import AutoencoderKLWan

    from training.data import build_dataset, collate

    assert cfg.model.path, "training.config.validate: task=vae needs model.path"
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # every file the run writes is listed in its run manifest first: overwrite=true removes those, nothing else
    ckpt.record_run_files(run_dir, "config.yaml", "metrics.jsonl", "final/vae", "final/.vae.tmp", folders=("final",))
    write_text_atomic(run_dir / "config.yaml", config_yaml(cfg))
    torch.manual_seed(cfg.train.seed)
    generator = torch.Generator().manual_seed(cfg.train.seed)
    dataset = build_dataset(cfg.data, cfg.train.seed, cfg.model)
    sampler = ResumableSampler(len(dataset), seed=cfg.train.seed)

    resume_from = ckpt.resolve_resume(cfg.resume, run_dir)
    source = resume_from / "vae" if resume_from else Path(cfg.model.path) / "vae"
    vae = AutoencoderKLWan.from_pretrained(source, dtype=torch.float32).train()
    train_encoder = cfg.vae.trainable == "all"
    if not train_encoder:
        freeze_encoder(vae)
    params = [p for p in vae.parameters() if p.requires_grad]
    history = _earlier_training(Path(cfg.model.path) / "vae" / "trained.json", run_dir)
    beta1, beta2 = cfg.train.betas  # two: training.config.validate
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(beta1, beta2), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_multiplier(cfg.train.lr_schedule, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio)
    )
    step, samples = 0, 0
    metrics = run_dir / "metrics.jsonl"
    if resume_from is not None:
        state = ckpt.load_state(resume_from / ckpt.STATE_FILE)
        ckpt.restore_optimizer(opt, sched, state)  # a changed train.lr takes effect on resume
        rank_state = ckpt.load_state(resume_from / "rank0.pt")
        generator.set_state(rank_state["generator"])
        sampler.load_state_dict(rank_state["data"])
        samples, step = rank_state["data"]["samples_consumed"], state["step"]
        print(f"resumed from {resume_from} at step {step}")
        ckpt.trim_metrics(metrics, step)
    else:
        metrics.write_text("")
    n_params = sum(p.numel() for p in params)
    print(
        f"vae: {source} ({n_params / 1e6:.2f}M trainable parameters: {cfg.vae.trainable}), clips {len(dataset)}, "
        f"crop {cfg.vae.crop}, latent noise {cfg.vae.latent_noise}, edge weight {cfg.vae.edge_weight}, precision {cfg.train.precision}"
    )

    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        num_workers=cfg.data.num_workers,
        drop_last=True,
        collate_fn=collate,
    )
    sampler.samples_consumed = samples
    batches = iter(loader)
    progress = tqdm(total=cfg.train.steps, initial=step, desc="vae", dynamic_ncols=True)
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        batch = next(batches)
        samples += len(batch["caption"])
        video = _random_crop(batch["video"], cfg.vae.crop, generator)
        with autocast_for(cfg.train.precision):
            loss, l1 = vae_loss(
                vae,
                video,
                cfg.vae.kl_weight,
                cfg.vae.object_weight,
                train_encoder,
                latent_noise=cfg.vae.latent_noise,
                generator=generator,
                edge_weight=cfg.vae.edge_weight,
            )
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step + 1}: non-finite VAE loss {loss.item()}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip or float("inf"))
        opt.step()
        sched.step()
        step += 1
        row = {
            "step": step,
            "loss": loss.item(),
            "l1": l1.item(),
            "lr": sched.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "step_time": time.perf_counter() - t0,
        }
        with metrics.open("a") as f:
            f.write(json.dumps(row) + "\n")
        progress.update(1)
        progress.set_postfix(loss=f"{row['loss']:.4f}", l1=f"{row['l1']:.4f}")
        if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps):
            tmp = ckpt.begin_checkpoint(run_dir, step)
            vae.save_pretrained(str(tmp / "vae"), safe_serialization=True)
            ckpt.save_state({"generator": generator.get_state(), "data": sampler.state_dict(samples)}, tmp / "rank0.pt")
            ckpt.save_state(
                {
                    "step": step,
                    "stage": "vae",
                    "optimizer": opt.state_dict(),
                    "lr_scheduler": sched.state_dict(),
                    "nonfinite_in_a_row": 0,
                    "world_size": 1,
                },
                tmp / ckpt.STATE_FILE,
            )
            (tmp / "config.yaml").write_text(config_yaml(cfg))
            ckpt.finish_checkpoint(run_dir, step, cfg.checkpoint.keep)
    progress.close()

    vae.eval()
    if train_encoder:
        mean, std = latent_statistics(vae, dataset, cfg.vae.stats_samples)
        vae.register_to_config(latents_mean=mean, latents_std=std)
    else:  # same encoder, same latents: the statistics the transformer was trained with stay
        std = vae.config.latents_std
    with torch.no_grad():
        full = collate([dataset[i] for i in range(min(4, len(dataset)))])["video"]
        recon = vae.decode(vae.encode(full).latent_dist.mean).sample
        psnr = (10 * torch.log10(4.0 / F.mse_loss(recon, full))).item()
    print(f"reconstruction PSNR on {len(full)} full clips: {psnr:.1f} dB; latent std per channel {std}")
    final = run_dir / "final" / "vae"
    tmp = final.with_name(".vae.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    vae.save_pretrained(str(tmp), safe_serialization=True)
    record = {"steps": step, "psnr_db": round(psnr, 2), "run": str(run_dir), "trainable": cfg.vae.trainable}
    (tmp / "trained.json").write_text(json.dumps({**record, "history": history}) + "\n")
    replace_dir(tmp, final)
    targets = [final]
    if cfg.vae.export:  # e.g. the model directory's vae/: copied beside it, then swapped in
        export = Path(cfg.vae.export)
        staged = export.with_name("." + export.name + ".new")
        if staged.exists():
            shutil.rmtree(staged)
        shutil.copytree(final, staged)
        replace_dir(staged, export)
        targets.append(export)
    print("wrote " + ", ".join(map(str, targets)))
    return 0


def training_records(trained_json: Path) -> list[dict[str, Any]]:
    """The runs recorded in an installed VAE's ``trained.json``, oldest first ([] without one)."""
    if not trained_json.is_file():
        return []
    rec = json.loads(trained_json.read_text())
    return [*rec.pop("history", []), rec]


def _earlier_training(trained_json: Path, run_dir: Path) -> list[dict[str, Any]]:
    """The runs that trained the VAE before this one, from the source VAE's ``trained.json`` (this run's
    own earlier record, left there by a finished run whose steps then grew, is dropped)."""
    return [r for r in training_records(trained_json) if Path(r.get("run", "")) != run_dir]


def vae_runs(trained_json: Path) -> dict[str, int]:
    """``{run directory: steps}`` of the runs recorded in an installed VAE's ``trained.json`` that still
    count: a decoder-only run is void once a later run retrained the encoder (it fitted other latents)."""
    kept: list[dict[str, Any]] = []
    for r in training_records(trained_json):
        if r.get("trainable", "all") == "all":
            kept = [k for k in kept if k.get("trainable") != "decoder"]
        kept.append(r)
    return {str(Path(r["run"])): r["steps"] for r in kept}


def main(argv: list[str] | None = None) -> int:
    """``python -m training.vae --config factory/configs/vae.yaml [key=value ...]``: trains ``model.path``'s VAE
    (behind the error boundary of :func:`common.errors.run_cli`; the run folder is locked for the run)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="training.vae")


def _main(argv: list[str] | None) -> int:
    import argparse

    from training.config import check_data_source, load_config
    from training.lock import hold_run_dir

    p = argparse.ArgumentParser(prog="python -m training.vae", description=main.__doc__)
    p.add_argument("--config", required=True, help="a YAML file with task: vae (factory/configs/vae*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=10 resume=latest")
    args = p.parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, "task=vae"])
    check_data_source(cfg.data)  # a data.path the source would not read
    with hold_run_dir(cfg.run_dir):
        replaced = ckpt.check_new_run(cfg.run_dir, cfg.resume, cfg.overwrite)
        if replaced:
            ckpt.clear_run(cfg.run_dir)
        return train_vae(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
