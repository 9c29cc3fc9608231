"""The product's front end: the same prompt through FlashAttention, linear attention and MHLA, side by side.

    python run_app.py                                   # the built-in model (trained on moving shapes), 127.0.0.1:7860
    python run_app.py --model tiny-random               # the tiny random-weight model (fastest; videos are noise)
    python run_app.py --model /models/Wan2.1-T2V-1.3B-Diffusers --variant mhla=ckpt/wan-mhla
    python run_app.py --random-weights 1.3b             # true-size latency, videos are noise
    python run_app.py --store-examples                  # precompute the example prompts' results (stored with the model)

Serves on 127.0.0.1 unless --host says otherwise; a public share link only with --share.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

# before gradio is imported: no analytics calls (the app must run with no network at all)
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public gradio share link")
    p.add_argument(
        "--model",
        default=None,
        help="local diffusers-format Wan directory, Wan2.1 or Wan2.2, text- or image-to-video (the page then asks for "
        "the first frame) (default: the built-in model; tiny-random: the tiny random-weight model)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a fine-tuned transformer for a variant, e.g. mhla=ckpt/wan-mhla (repeatable)",
    )
    p.add_argument(
        "--random-weights",
        choices=("1.3b", "14b"),
        default=None,
        help="Wan2.1 architecture at true size with random weights: real latency, videos are noise",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, float32 on CPU), float32, bfloat16, float16")
    p.add_argument(
        "--decode-dtype",
        default="auto",
        help="the VAE's dtype: auto (bfloat16 on a CPU with native bfloat16, where it decodes 2-3x faster; float32 "
        "on other CPUs, where bfloat16 is emulated and 16x slower; else the model's), float32, "
        "bfloat16, float16",
    )
    p.add_argument(
        "--store-examples",
        action="store_true",
        help="run each example prompt through every variant at the model's defaults, store the results with the "
        "model (<model>/examples/: small videos and results.json, with machine and date) and exit; the page opens "
        "with them",
    )
    p.add_argument(
        "--offload",
        choices=("none", "model", "group", "sequential"),
        default="none",
        help="diffusers' offload hooks, applied once after loading: model (one component on the device at a time), "
        "group (block-level group offloading), sequential (one layer's weights at a time); default none",
    )
    p.add_argument("--vae-tiling", action="store_true", help="decode videos in overlapping 256 px tiles")
    from pipelines.cli import add_speed_arguments

    add_speed_arguments(p)  # --cache, --compile: the generation CLI's definitions and checks
    p.add_argument(
        "--preview-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="a live preview of each running variant every STEPS denoising steps (a fast colour map of its denoised "
        "estimate; 0: none; default 4)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="largest compare request in latent tokens (default: 8192 on CPU, no limit on GPU)",
    )
    p.add_argument(
        "--max-bench-tokens",
        type=int,
        default=None,
        help="largest benchmark grid in tokens (default: 16384 on CPU, no limit on GPU)",
    )
    return p.parse_args(argv)


def compose(
    model,
    variant_dirs,
    random_weights,
    device,
    dtype,
    decode_dtype="auto",
    offload="none",
    vae_tiling=False,
    compile="none",
    cache=None,
):
    """The app's models, with the analyser of the built-in model's world as their ``judge`` when that model is
    served (its verdict column). The composition happens here so that ``app/`` imports nothing beside it."""
    from app.models import load_app_models

    models = load_app_models(
        model, variant_dirs, random_weights, device, dtype, decode_dtype, offload, vae_tiling, compile, cache
    )
    if models.builtin:
        from world.analyse import strict_verdicts
        from world.synthetic import sample_clips

        models.judge = strict_verdicts  # judged as a person would: objects counted, a band is not a square
        models.clip_source = sample_clips  # the live previews' colour map, fitted on clips of its world
    return models


def main(argv=None) -> int:
    """Serves the app, behind the error boundary of :func:`common.errors.run_cli` (exit codes there)."""
    from common.errors import run_cli

    return run_cli(_main, argv, prog="run_app")


def _main(argv) -> int:
    args = parse_args(argv)
    from app.compare import CPU_MAX_TOKENS
    from app.models import parse_variant_dirs

    if args.model is not None and args.random_weights is not None:
        raise ValueError("--model and --random-weights exclude each other: random weights replace the model's")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: expected a port number in 0 ... 65535")
    if args.preview_every is not None and args.preview_every < 0:
        raise ValueError(f"--preview-every {args.preview_every}: expected 0 (no previews) or a number of steps")
    for name in ("max_tokens", "max_bench_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: expected a positive number of tokens")
    from pipelines.loading import resolve_device, resolve_dtype
    from pipelines.memory import check_offload

    resolve_dtype(args.dtype, resolve_device(args.device))  # named before any model loads
    check_offload(args.offload, resolve_device(args.device))
    variant_dirs = parse_variant_dirs(args.variant)
    from pipelines.model_dir import ModelDir

    # the model folder described once for the whole run: checked here, read by the page's facts and by loading
    folder = ModelDir(args.model) if args.random_weights is None else None
    if folder is not None and not folder.tiny_random and args.model is not None:
        folder.check()
        if args.store_examples and folder.index.image_to_video:
            raise ValueError(
                f"--store-examples: model {args.model!r} is image-to-video; its runs need an uploaded first frame, "
                "so it has no stored example results"
            )
    from app.compare import Warmup, store_examples, warm_up
    from app.models import describe_app_models

    load_args = (folder, variant_dirs, args.random_weights, args.device, args.dtype)
    memory_args = (args.offload, args.vae_tiling, args.compile, args.cache)
    if args.store_examples:
        models = compose(*load_args, args.decode_dtype, *memory_args)
        # once, before the stored runs: none of them pays for cold caches
        print(f"warm-up: {warm_up(models):.1f} s")
        if models.stored_dir is None:
            print("error: --store-examples needs a model folder (not random weights)", file=sys.stderr)
            return 2
        path = store_examples(models, models.stored_dir, models.example_prompts, progress=print)
        size = sum(f.stat().st_size for f in path.parent.iterdir())
        print(f"wrote {path} and its videos ({size / 1024:.0f} KB in all)")
        return 0

    # The page is served from the model's files (what it shows before a weight loads), then the models load and
    # warm up in the background: importing diffusers and loading took about half of a 29 s start, the page
    # answers in about half that. Runs wait for both, and the page says what is going on.
    facts = describe_app_models(*load_args, *memory_args)
    cpu = facts.device.type == "cpu"
    max_tokens = args.max_tokens if args.max_tokens is not None else (CPU_MAX_TOKENS if cpu else None)
    max_bench = args.max_bench_tokens if args.max_bench_tokens is not None else (16384 if cpu else None)

    def load():
        started = time.monotonic()
        models = compose(*load_args, args.decode_dtype, *memory_args)
        print(f"model loaded in {time.monotonic() - started:.1f} s (in the background); warming up", flush=True)
        return models

    from app.preview import PREVIEW_EVERY
    from app.ui import CSS, QUEUE_SIZE, SESSIONS_KEPT, THEME, build_demo

    every = PREVIEW_EVERY if args.preview_every is None else args.preview_every
    warmup = Warmup.loading(load, previews=every > 0)
    demo = build_demo(facts, max_tokens=max_tokens, max_bench_tokens=max_bench, warmup=warmup, preview_every=every)
    print(f"model: {facts.source} on {facts.device}" + (f" ({facts.memory})" if facts.memory else ""))
    if facts.speed:
        print(f"speed: {facts.speed}")
    if facts.random_note:
        print(f"NOTE: {facts.random_note}")
    if not args.share:
        # gradio's own lines would suggest "share=True in launch()"; this launcher's flag is --share
        print(f"serving on http://{args.host}:{args.port} (a public link: --share)", flush=True)
    demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE).launch(
        quiet=not args.share,  # with --share, gradio prints the public link
        server_name=args.host,
        server_port=args.port,
        share=args.share,
        show_error=False,
        theme=THEME,
        css=CSS,
        ssr_mode=False,
        footer_links=["api", "settings"],
        prevent_thread_lock=True,  # returns once the server answers: then the models load
        state_session_capacity=SESSIONS_KEPT,  # each tab's page state in memory: the last 64, not gradio's 10,000
    )
    warmup.start()
    print("loading the model and warming up in the background (runs wait for them)", flush=True)
    demo.block_thread()
    return 0


if __name__ == "__main__":
    from common.threads import enable_auto

    enable_auto()  # torch's threads: the cores other work leaves (asked again per request), unless OMP_NUM_THREADS is set
    code = main()
    if any(t.name == "warm-up" and t.is_alive() for t in threading.enumerate()):
        # stopped while the background warm-up is inside torch: the interpreter's teardown would abort under it
        # ("terminate called without an active exception", exit 134 instead of 143)
        from pipelines.context_parallel import exit_process

        exit_process(code)
    sys.exit(code)
