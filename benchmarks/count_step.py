"""Bytes and FLOPs per operation of the Wan2.1 transformer step outside self-attention, counted, and what
``--compile`` should make of the measured 466 ms (no GPU: the model runs on PyTorch's meta device).

    python -m benchmarks.count_step                  # 1.3B, batch 2 (CFG), 81x480x800 = 31,500 tokens, bf16
    python -m benchmarks.count_step --out benchmarks/results/count_step_1.3b_31500

Every aten operation of one forward is recorded with its tensors' shapes and dtypes (what the measured run timed as
self-attention, its RoPE and attention op, left out: the part the variants change). Per operation: FLOPs (matrix products and the
cross-attention's SDPA: 2*m*n*k per product) and bytes (every input read and output written once, views
free). Eager time: each operation is one kernel at max(bytes / bandwidth, FLOPs / matmul rate). Compiled
(inductor): each maximal run of operations between matrix products (norms, modulation, gates, residual
adds, GELU, casts) becomes one kernel that reads only what comes from outside the run and writes only
what is used after it; the products stay cuBLAS/cuDNN calls. The rates are the H100's measured ones
(copy 2.97 TB/s, bf16 matmul 755 TFLOP/s on 8192^3), then scaled by one efficiency per kind, fitted so the
eager count matches the measured 466 ms. The prediction is the compiled count under the same efficiencies.
A count, not a measurement: the next GPU run (benchmarks/run_gpu.sh, stage compile) checks it.

    python -m benchmarks.count_step --config 14b --grid 21x45x80 --out benchmarks/results/count_step_14b_75600

Another model or size (Wan2.1-14B at 720p: 81x720x1280 = 75,600 tokens) is predicted from the same fit: its rest
counted the same way at the fitted efficiencies; softmax attention (cuDNN) at the FLOP rate the measured run's
self-attention reached (4*B*H*N^2*D FLOPs per layer: QK^T and PV); linear and MHLA attention scaled from their
measured time per layer by B*H*N (their work is N*D^2 per head; D = 128 in both models), which keeps the fixed
cost per call (~0.5 ms) in proportion and so overestimates them a little. Also the step's memory: the weights
and the largest set of activations alive at once (each tensor from the operation that writes it to the last that
reads it; allocator slack and cuDNN/cuBLAS workspaces not counted), checked by stage 14b (benchmarks.wan_14b).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import RESULTS
from pipelines.attention import HYBRID, LINEAR, MHLA, SOFTMAX

VIEWS = {
    "view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze", "slice",
    "select", "as_strided", "alias", "detach", "unflatten", "flatten", "split", "chunk", "unbind", "view_as",
    "expand_as", "_reshape_alias", "split_with_sizes", "lift_fresh", "view_as_real", "view_as_complex",
    "empty", "empty_like", "empty_strided", "new_empty", "_to_copy_noop", "unsafe_split",
}  # fmt: skip
PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm"}
ATTENTION = {
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_efficient_attention", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}  # fmt: skip
# measured on the H100 of 2026-11-26 (benchmarks/results/h100-2026-11-26/optime.log's ceilings)
COPY_BPS = 2.97e12
MATMUL_FLOPS = 755e12
MEASURED_REST_MS = 466.0  # flash's step 1237 ms less its self-attention 772 ms (same run, 81x480x800)
MEASURED = {SOFTMAX: (1237.4, 771.5), LINEAR: (493.1, 29.8), MHLA: (509.2, 43.2), HYBRID: (752.3, 283.0)}
# the point those were measured at: Wan2.1-1.3B (30 layers, 12 heads x 128), batch 2, 21x30x50, 512 text tokens
CALIBRATION = {"config": "1.3b", "grid": (21, 30, 50), "batch": 2, "text_len": 512}
# the H200's HBM3e (4.8 TB/s) against the H100 SXM's HBM3 (3.35 TB/s); same SMs and clocks, so the same FLOP rates
H200_BANDWIDTH_SCALE = 4.8 / 3.35


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Recorder(TorchDispatchMode):
    """Each non-view aten operation: name, FLOPs, the ids of the storages it reads and writes, with sizes."""

    def __init__(self, self_attention_tokens: int) -> None:
        super().__init__()
        self.ops: list[dict[str, Any]] = []
        self.root: dict[int, int] = {}  # id(tensor) -> id of the tensor whose memory it is (views)
        self.keep: list[torch.Tensor] = []  # every tensor seen stays alive, so ids are not reused
        self.n = self_attention_tokens

    def _root(self, t: torch.Tensor) -> int:
        return self.root.get(id(t), id(t))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        ins = [a for a in _flat(args) + _flat(list(kwargs.values())) if isinstance(a, torch.Tensor)]
        outs = [o for o in _flat([out]) if isinstance(o, torch.Tensor)]
        self.keep += ins + outs
        if name in VIEWS or name.endswith("_") and name[:-1] in VIEWS:
            src = self._root(ins[0]) if ins else None
            for o in outs:
                if src is not None:
                    self.root[id(o)] = src
            return out
        if name in ATTENTION and ins and ins[1].shape[-2] == self.n:  # (B, H, S, D): self-attention's keys
            return out  # the variants' part: not counted here
        flops = 0
        if name in PRODUCTS or name in ATTENTION:
            flops = _flops(name, ins, outs)
        self.ops.append(
            dict(
                name=name,
                flops=flops,
                reads={self._root(t): _nbytes(t) for t in ins},
                writes={self._root(o): _nbytes(o) for o in outs},
                kind="product" if flops else "elementwise",
            )
        )
        return out


def _flat(xs: Any) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out += _flat(x)
        else:
            out.append(x)
    return out


def _flops(name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    if name in ATTENTION:  # q (B, H, S, D), k (B, H, L, D): QK^T and PV
        q, k = ins[0], ins[1]
        return 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    o = outs[0]
    mats = [t for t in ins if t.dim() >= 2]
    k = mats[-1].shape[-2] if name in ("mm", "bmm", "addmm", "baddbmm", "matmul") else mats[-1].shape[-1]
    return 2 * o.numel() * k


def record(config: dict, batch: int, grid: tuple[int, int, int], text_len: int, dtype: torch.dtype) -> list[dict]:
    from benchmarks.wan_step import build_transformer, latent_inputs
    from pipelines import convert_self_attention

    device = torch.device("meta")
    model = convert_self_attention(build_transformer(config, device, dtype), SOFTMAX)
    # what the timers of the measured run counted as self-attention (RoPE and the attention op, in the
    # processors' attend) is left out; the projections and q/k norms around it are the rest
    for proc in model.attn_processors.values():
        if hasattr(proc, "attend"):
            proc.attend = lambda attn, q, k, v, rope, hidden: torch.empty_like(v)
    gen = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        inputs = latent_inputs(config, grid, batch, text_len, "cpu", dtype, gen)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    rec = Recorder(grid[0] * grid[1] * grid[2])
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One fused kernel (as cuDNN's): reads q, k, v, writes o; the self-attention's is not counted."""
        out = torch.empty(*query.shape[:-1], value.shape[-1], dtype=query.dtype, device=query.device)
        if key.shape[-2] != rec.n:  # cross-attention: part of the rest
            rec.ops.append(
                dict(
                    name="sdpa (cross-attention)",
                    flops=_flops("scaled_dot_product_attention", [query, key], [out]),
                    reads={rec._root(t): _nbytes(t) for t in (query, key, value)},
                    writes={id(out): _nbytes(out)},
                    kind="product",
                )
            )
        rec.keep.append(out)
        return out

    real_rms = torch.nn.functional.rms_norm

    def rms_norm(x: torch.Tensor, shape: Any, weight: torch.Tensor | None = None, eps: Any = None) -> torch.Tensor:
        """One kernel on a GPU (PyTorch's fused RMSNorm); the meta device would decompose it into five."""
        out = torch.empty_like(x)
        reads = {rec._root(x): _nbytes(x)}
        if weight is not None:
            reads[rec._root(weight)] = _nbytes(weight)
        rec.ops.append(dict(name="rms_norm", flops=0, reads=reads, writes={id(out): _nbytes(out)}, kind="elementwise"))
        rec.keep.append(out)
        return out

    torch.nn.functional.scaled_dot_product_attention = sdpa
    torch.nn.functional.rms_norm = rms_norm
    try:
        with torch.no_grad(), rec:
            model(**inputs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
        torch.nn.functional.rms_norm = real_rms
    return rec.ops


def peak_live_bytes(ops: list[dict]) -> int:
    """The most bytes of tensors the operations write that are alive at once: each from the operation that first
    writes it to the last one that reads it (weights and inputs, never written, are not counted)."""
    first: dict[int, tuple[int, int]] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for sid, b in op["writes"].items():
            first.setdefault(sid, (i, b))
            last[sid] = i
        for sid in op["reads"]:
            if sid in first:
                last[sid] = i
    born: dict[int, int] = {}
    dies: dict[int, int] = {}
    for sid, (i, b) in first.items():
        born[i] = born.get(i, 0) + b
        dies[last[sid]] = dies.get(last[sid], 0) + b
    live = peak = 0
    for i in range(len(ops)):
        live += born.get(i, 0)
        peak = max(peak, live)
        live -= dies.get(i, 0)
    return peak


def eager_cost(ops: list[dict]) -> dict[str, float]:
    by = {"product": [0.0, 0.0, 0], "elementwise": [0.0, 0.0, 0]}
    for op in ops:
        b = sum(op["reads"].values()) + sum(op["writes"].values())
        by[op["kind"]][0] += b
        by[op["kind"]][1] += op["flops"]
        by[op["kind"]][2] += 1
    return {f"{k}_{m}": v[i] for k, v in by.items() for i, m in enumerate(("bytes", "flops", "kernels"))}


def compiled_cost(ops: list[dict]) -> dict[str, float]:
    """Runs of elementwise operations fused: one kernel each, reading what comes from before the run,
    writing what is read after it."""
    later_reads: list[set[int]] = [set() for _ in ops]  # storages read by ops after i
    seen: set[int] = set()
    for i in range(len(ops) - 1, -1, -1):
        later_reads[i] = set(seen)
        seen |= set(ops[i]["reads"])
    products_bytes = products_flops = fused_bytes = 0.0
    kernels = products = 0
    i = 0
    while i < len(ops):
        op = ops[i]
        if op["kind"] == "product":
            products_bytes += sum(op["reads"].values()) + sum(op["writes"].values())
            products_flops += op["flops"]
            products += 1
            i += 1
            continue
        j = i
        made: dict[int, int] = {}
        read: dict[int, int] = {}
        while j < len(ops) and ops[j]["kind"] != "product":
            for s, b in ops[j]["reads"].items():
                if s not in made:
                    read[s] = b
            made.update(ops[j]["writes"])
            j += 1
        after = later_reads[j - 1]
        fused_bytes += sum(read.values()) + sum(b for s, b in made.items() if s in after)
        kernels += 1
        i = j
    return dict(
        product_bytes=products_bytes,
        product_flops=products_flops,
        product_kernels=products,
        elementwise_bytes=fused_bytes,
        elementwise_flops=0.0,
        elementwise_kernels=kernels,
    )


def ideal_ms(c: dict[str, float]) -> tuple[float, float]:
    """(products ms, elementwise ms) at the measured ceilings: products at the matmul rate (they are
    FLOP-bound at these sizes), the rest at the copy rate."""
    return c["product_flops"] / MATMUL_FLOPS * 1e3, c["elementwise_bytes"] / COPY_BPS * 1e3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.count_step", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="1.3b")
    p.add_argument("--grid", default="21x30x50", help="latent tokens FxHxW (81x480x800 = 21x30x50)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=None, help="default: the config's (counted with 1 and 2)")
    p.add_argument("--product-efficiency", type=float, default=0.8, help="of the matmul rate, for these shapes")
    p.add_argument("--out", default=str(RESULTS / "count_step_1.3b_31500"), help="path without extension")
    return p.parse_args(argv)


def counted(config: dict, grid: tuple[int, int, int], batch: int, text_len: int, layers: int) -> dict[str, dict]:
    """Eager and compiled counts of the step outside self-attention at ``layers`` layers (counted at 1 and 2 and
    extended: the layers are alike), each per layer too, and the largest set of activations alive at once."""
    per: dict[str, dict[str, float]] = {}
    peak = 0
    for mode, cost in (("eager", eager_cost), ("compiled", compiled_cost)):
        ops1 = record(dict(config, num_layers=1), batch, grid, text_len, torch.bfloat16)
        ops2 = record(dict(config, num_layers=2), batch, grid, text_len, torch.bfloat16)
        one, two = cost(ops1), cost(ops2)
        per[mode] = {k: one[k] + (layers - 1) * (two[k] - one[k]) for k in one}
        per[mode + "_per_layer"] = {k: two[k] - one[k] for k in one}
        peak = max(peak_live_bytes(ops1), peak_live_bytes(ops2))
    per["memory"] = {"activations_peak_bytes": float(peak)}
    return per


def weight_bytes(config: dict, layers: int) -> dict[str, float]:
    """Bytes of the transformer's weights in bf16 (diffusers keeps some modules in float32), built on the meta
    device: the whole model and one layer."""
    from benchmarks.wan_step import build_transformer

    def size(n: int) -> int:
        model = build_transformer(dict(config, num_layers=n), torch.device("meta"), torch.bfloat16)
        return sum(p.numel() * p.element_size() for p in model.parameters())

    base, one = size(0), size(1)
    return {"weights_bytes": float(base + layers * (one - base)), "per_layer_bytes": float(one - base)}


def attention_ms(config: dict, grid: tuple[int, int, int], batch: int, layers: int) -> dict[str, float]:
    """Self-attention per step by variant kind at the target, scaled from the measured run (see the module's
    docstring): softmax at the FLOP rate it reached there, linear and MHLA by batch x heads x tokens."""
    from pipelines.loading import WAN_CONFIGS

    cal = WAN_CONFIGS[CALIBRATION["config"]]
    n_cal, b_cal = math.prod(CALIBRATION["grid"]), CALIBRATION["batch"]
    h_cal, d_cal, l_cal = cal["num_attention_heads"], cal["attention_head_dim"], cal["num_layers"]
    n, h, d = math.prod(grid), config["num_attention_heads"], config["attention_head_dim"]
    softmax_flops_cal = 4 * b_cal * h_cal * n_cal**2 * d_cal * l_cal
    rate = softmax_flops_cal / (MEASURED[SOFTMAX][1] / 1e3)
    softmax_flops = 4 * batch * h * n**2 * d * layers
    scale = (batch * h * n * d**2) / (b_cal * h_cal * n_cal * d_cal**2)
    return {
        "softmax_flop_rate": rate,
        "softmax_flops": float(softmax_flops),
        "softmax_ms": softmax_flops / rate * 1e3,
        "linear_ms": MEASURED[LINEAR][1] / l_cal * scale * layers,
        "mhla_ms": MEASURED[MHLA][1] / l_cal * scale * layers,
        "work_scale_vs_measured": scale,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    from pipelines.attention import linear_layers_for
    from pipelines.loading import WAN_CONFIGS

    a = parse_args(argv)
    grid = cast(tuple[int, int, int], tuple(int(x) for x in a.grid.split("x")))
    assert len(grid) == 3
    config = dict(WAN_CONFIGS[a.config])
    layers = a.layers or config["num_layers"]
    target = {"config": a.config, "grid": grid, "batch": a.batch, "text_len": a.text_len}
    at_calibration = target == CALIBRATION and layers == WAN_CONFIGS[CALIBRATION["config"]]["num_layers"]
    per = counted(config, grid, a.batch, a.text_len, layers)
    if at_calibration:
        cal = per
    else:
        cal_config = WAN_CONFIGS[CALIBRATION["config"]]
        cal = counted(
            cal_config, CALIBRATION["grid"], CALIBRATION["batch"], CALIBRATION["text_len"], cal_config["num_layers"]
        )
    # the one fitted number: the elementwise efficiency that makes the eager count equal the measured rest
    cal_prod_ms, cal_elem_ms = ideal_ms(cal["eager"])
    cal_prod_ms /= a.product_efficiency
    elem_eff = cal_elem_ms / max(MEASURED_REST_MS - cal_prod_ms, 1e-9)
    prod_ms, elem_ms = ideal_ms(per["eager"])
    prod_ms /= a.product_efficiency
    elem_ms /= elem_eff
    c_prod, c_elem = ideal_ms(per["compiled"])
    c_prod /= a.product_efficiency
    c_elem /= elem_eff
    rest_c = c_prod + c_elem
    result: dict[str, Any] = {
        "meta": {
            "benchmark": "count_step",
            "config": a.config,
            "layers": layers,
            "grid": a.grid,
            "tokens": math.prod(grid),
            "batch": a.batch,
            "text_len": a.text_len,
            "dtype": "bf16",
            "copy_bps": COPY_BPS,
            "matmul_flops": MATMUL_FLOPS,
            "product_efficiency": a.product_efficiency,
            "elementwise_efficiency_fitted": elem_eff,
            "measured_rest_ms": MEASURED_REST_MS,
            "calibration": {**CALIBRATION, "grid": "x".join(map(str, CALIBRATION["grid"]))},
            "what": "counted on the meta device (no GPU); times are predictions",
        },
        "counts": per,
        "rest_ms": {
            "eager_products": prod_ms,
            "eager_elementwise_fitted": MEASURED_REST_MS - prod_ms if at_calibration else elem_ms,
            "compiled_products": c_prod,
            "compiled_elementwise": c_elem,
            "compiled_total": rest_c,
        },
    }
    if at_calibration:
        result["predictions"] = {
            v: {
                "eager_ms": step,
                "attention_ms": attn,
                "compiled_ms": rest_c + attn,
                "vs_flash_eager": MEASURED[SOFTMAX][0] / step,
                "vs_flash_compiled": (rest_c + MEASURED[SOFTMAX][1]) / (rest_c + attn),
            }
            for v, (step, attn) in MEASURED.items()
        }
    else:
        attn = attention_ms(config, grid, a.batch, layers)
        mhla_layers = len(linear_layers_for(HYBRID, layers))
        kinds = {
            SOFTMAX: attn["softmax_ms"],
            LINEAR: attn["linear_ms"],
            MHLA: attn["mhla_ms"],
            HYBRID: (attn["softmax_ms"] * (layers - mhla_layers) + attn["mhla_ms"] * mhla_layers) / layers,
        }
        # the H200: products as fast (the same SMs), elementwise kernels at its bandwidth
        rest = {"H100": (prod_ms + elem_ms, rest_c)}
        rest["H200"] = (
            prod_ms + elem_ms / H200_BANDWIDTH_SCALE,
            c_prod + c_elem / H200_BANDWIDTH_SCALE,
        )
        predictions: dict[str, dict[str, Any]] = {}
        for gpu, (rest_e, rest_comp) in rest.items():
            flash_e, flash_c = rest_e + kinds[SOFTMAX], rest_comp + kinds[SOFTMAX]
            predictions[gpu] = {
                v: {
                    "eager_ms": rest_e + ms,
                    "attention_ms": ms,
                    "compiled_ms": rest_comp + ms,
                    "vs_flash_eager": flash_e / (rest_e + ms),
                    "vs_flash_compiled": flash_c / (rest_comp + ms),
                    "fifty_steps_eager_s": (rest_e + ms) * 50 / 1e3,
                }
                for v, ms in kinds.items()
            }
            predictions[gpu]["softmax_attention_share_eager"] = kinds[SOFTMAX] / flash_e
            predictions[gpu]["softmax_attention_share_compiled"] = kinds[SOFTMAX] / flash_c
            predictions[gpu]["attention_free_bound_eager"] = flash_e / rest_e
            # the cuDNN rate at which MHLA is exactly 3x flash: a faster softmax than that and the target is missed
            for mode, r_mode in (("eager", rest_e), ("compiled", rest_comp)):
                need_ms = 3 * (r_mode + kinds[MHLA]) - r_mode
                predictions[gpu][f"softmax_rate_for_3x_{mode}"] = attn["softmax_flops"] / (need_ms / 1e3)
        result["attention"] = {**attn, "hybrid_mhla_layers": mhla_layers}
        result["memory"] = {**weight_bytes(config, layers), **per["memory"]}
        result["predictions"] = predictions
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(a.out + ".md").write_text(render(result))
    print(render(result))
    return result


def render(r: dict) -> str:
    m, c, t = r["meta"], r["counts"], r["rest_ms"]
    gb = 1e9
    lines = [
        f"# The Wan2.1-{m['config']} step outside self-attention, counted ({m['tokens']:,} tokens, batch {m['batch']}, "
        f"bf16, {m['layers']} layers; meta device, no GPU: the times are PREDICTIONS)",
        "",
        "| | kernels | bytes | FLOPs | ideal ms at 2.97 TB/s, 755 TFLOP/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in ("eager", "compiled"):
        x = c[mode]
        lines.append(
            f"| {mode}: matrix products (+ cross-attention) | {x['product_kernels']:.0f} | {x['product_bytes'] / gb:.1f} GB | "
            f"{x['product_flops'] / 1e12:.1f} T | {x['product_flops'] / MATMUL_FLOPS * 1e3:.0f} |"
        )
        lines.append(
            f"| {mode}: everything else (norms, modulation, gates, residuals, GELU, casts) | "
            f"{x['elementwise_kernels']:.0f} | {x['elementwise_bytes'] / gb:.1f} GB | - | "
            f"{x['elementwise_bytes'] / COPY_BPS * 1e3:.0f} |"
        )
    if "attention" in r:
        return "\n".join(lines + render_target(r))
    lines += [
        "",
        f"Fitted to the measured rest ({m['measured_rest_ms']:.0f} ms): products at {m['product_efficiency']:.0%} of the "
        f"matmul rate = {t['eager_products']:.0f} ms, so the eager elementwise kernels take {t['eager_elementwise_fitted']:.0f} ms "
        f"({m['elementwise_efficiency_fitted']:.0%} of the copy rate on average). Compiled, at the same efficiencies: "
        f"products {t['compiled_products']:.0f} ms + fused kernels {t['compiled_elementwise']:.0f} ms = "
        f"**{t['compiled_total']:.0f} ms** (predicted).",
        "",
        "| variant | eager step ms (measured) | attention ms (measured) | compiled step ms (predicted) | vs flash eager (measured) | vs same-compiled flash (predicted) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v, p in r["predictions"].items():
        lines.append(
            f"| {v} | {p['eager_ms']:.0f} | {p['attention_ms']:.0f} | {p['compiled_ms']:.0f} | {p['vs_flash_eager']:.2f}x | "
            f"{p['vs_flash_compiled']:.2f}x |"
        )
    lines.append("")
    return "\n".join(lines)


def render_target(r: dict) -> list[str]:
    """The prediction for a model or size other than the measured one (e.g. Wan2.1-14B at 720p)."""
    m, t, a, mem = r["meta"], r["rest_ms"], r["attention"], r["memory"]
    cal = m["calibration"]
    h100, h200 = r["predictions"]["H100"], r["predictions"]["H200"]
    gib = 2**30
    lines = [
        "",
        f"The rest of the step (everything but self-attention) at the efficiencies fitted on the measured run "
        f"(Wan2.1-{cal['config']}, {cal['grid']}, batch {cal['batch']}, H100: products at {m['product_efficiency']:.0%} "
        f"of the matmul rate, elementwise kernels at {m['elementwise_efficiency_fitted']:.0%} of the copy rate): eager "
        f"{t['eager_products']:.0f} ms products + {t['eager_elementwise_fitted']:.0f} ms elementwise; compiled "
        f"{t['compiled_products']:.0f} + {t['compiled_elementwise']:.0f} = {t['compiled_total']:.0f} ms.",
        "",
        f"Self-attention per step, {m['layers']} layers: softmax (cuDNN) {a['softmax_flops'] / 1e15:.2f} PFLOP "
        f"(4*B*H*N^2*D per layer) at the {a['softmax_flop_rate'] / 1e12:.0f} TFLOP/s the measured run's reached = "
        f"**{a['softmax_ms']:.0f} ms**; MHLA {a['mhla_ms']:.0f} ms and linear {a['linear_ms']:.0f} ms (the measured "
        f"ms per layer x {a['work_scale_vs_measured']:.2f}, the ratio of B*H*N*D^2); mhla-hybrid: "
        f"{a['hybrid_mhla_layers']} MHLA layers, {m['layers'] - a['hybrid_mhla_layers']} softmax.",
        "",
        "| variant | eager step ms (H100 / H200) | compiled step ms (H100 / H200) | attention ms | vs flash eager "
        "(H100 / H200) | vs same-compiled flash (H100 / H200) | 50 steps eager s (H200) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in (SOFTMAX, LINEAR, MHLA, HYBRID):
        p, q = h100[v], h200[v]
        lines.append(
            f"| {v} | {p['eager_ms']:.0f} / {q['eager_ms']:.0f} | {p['compiled_ms']:.0f} / {q['compiled_ms']:.0f} | "
            f"{p['attention_ms']:.0f} | {p['vs_flash_eager']:.2f}x / {q['vs_flash_eager']:.2f}x | "
            f"{p['vs_flash_compiled']:.2f}x / {q['vs_flash_compiled']:.2f}x | {q['fifty_steps_eager_s']:.0f} |"
        )
    lines += [
        "",
        f"Softmax attention's share of flash's step: {h100['softmax_attention_share_eager']:.0%} eager, "
        f"{h100['softmax_attention_share_compiled']:.0%} compiled (H100; H200 {h200['softmax_attention_share_eager']:.0%}"
        f" / {h200['softmax_attention_share_compiled']:.0%}); an attention-free step would be "
        f"{h100['attention_free_bound_eager']:.2f}x faster eager (H200 {h200['attention_free_bound_eager']:.2f}x). "
        "H200: the same FLOP rates as the H100 (same SMs and clocks), elementwise kernels "
        f"{H200_BANDWIDTH_SCALE:.2f}x faster (4.8 vs 3.35 TB/s).",
        "",
        "The prediction hangs on cuDNN's rate at 75,600 tokens, which no run has measured: MHLA is exactly 3x flash "
        f"when softmax attention runs at {h100['softmax_rate_for_3x_eager'] / 1e12:.0f} TFLOP/s eager and "
        f"{h100['softmax_rate_for_3x_compiled'] / 1e12:.0f} compiled (H100; H200 "
        f"{h200['softmax_rate_for_3x_eager'] / 1e12:.0f} / {h200['softmax_rate_for_3x_compiled'] / 1e12:.0f}); a faster "
        f"softmax than that misses the 3x target. Assumed: {a['softmax_flop_rate'] / 1e12:.0f} TFLOP/s, the rate at "
        "31,500 tokens (longer sequences usually run a little faster).",
        "",
        f"Memory: weights {mem['weights_bytes'] / gib:.1f} GiB ({mem['per_layer_bytes'] / gib:.2f} GiB a layer); the "
        f"largest set of activations alive at once outside self-attention {mem['activations_peak_bytes'] / gib:.1f} GiB "
        f"(batch {m['batch']}): about {(mem['weights_bytes'] + mem['activations_peak_bytes']) / gib:.0f} GiB for the "
        "step, before allocator slack, attention workspaces and the variants' own few parameters.",
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
    sys.exit(0)
