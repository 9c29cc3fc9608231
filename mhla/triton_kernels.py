"""The Triton kernels of MHLA (and linear attention): summaries, output, and the two backward passes.

Kernels only: what each program computes. Launch settings, autotuning, the autograd function and the
checks of their inputs are :mod:`mhla.triton_ops`, the layer everything else calls; the math they
implement is written out there and in :mod:`mhla.reference`.

A program owns one (batch, head, block) and walks the block's tokens, whose positions it computes from
the layout's split points, so uneven layouts need no index tensors or padding. Channels are processed
as two halves (even and odd) so RoPE's interleaved pairs rotate without shuffles.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path in ops.py is used
    triton = None

FEATURE_IDS = {"relu": 0, "elu": 1}
RELU_EPS = 1e-6  # same as mhla.feature_maps.RELU_EPS
KERNEL_NAMES = ("summaries", "output", "backward_query", "backward_key")


if triton is not None:

    @triton.jit
    def _phi(x, FEATURE: tl.constexpr):
        if FEATURE == 0:
            return tl.maximum(x, 0.0) + 1e-6
        else:
            return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))

    @triton.jit
    def _dphi(x, FEATURE: tl.constexpr):
        if FEATURE == 0:
            return (x > 0).to(tl.float32)
        else:
            return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))

    @triton.jit
    def _segment(i, size, parts):
        """Start and length of segment i when `size` cells split into `parts` (longer ones first)."""
        base = size // parts
        extra = size % parts
        start = i * base + tl.minimum(i, extra)
        length = base + (i < extra).to(tl.int32)
        return start, length

    @triton.jit
    def _block_geometry(blk, GF, GH, GW, BF, BH, BW):
        i_f = blk // (BH * BW)
        i_h = (blk // BW) % BH
        i_w = blk % BW
        f0, lf = _segment(i_f, GF, BF)
        h0, lh = _segment(i_h, GH, BH)
        w0, lw = _segment(i_w, GW, BW)
        return f0, h0, w0, lf, lh, lw

    @triton.jit
    def _token_ids(j, f0, h0, w0, lh, lw, GH, GW):
        """Token index of the j-th token (in (f, h, w) order) of the block starting at (f0, h0, w0)."""
        f = f0 + j // (lh * lw)
        r = j % (lh * lw)
        return (f * GH + h0 + r // lw) * GW + w0 + r % lw

    @triton.jit
    def _load_halves(ptr, rows, row_stride, d_stride, mask_rows, D_HALF, BLOCK_N, BLOCK_D, WIDE: tl.constexpr):
        """Loads even and odd channels of a (BLOCK_N, D) tile as two (BLOCK_N, D/2) float32 tiles.

        WIDE (v2) reads each row contiguously, so the loads are 16 bytes wide, and splits the channels
        in registers; otherwise (v1) each half is a strided read of single elements."""
        d = tl.arange(0, BLOCK_D)
        if WIDE:
            ch = tl.arange(0, 2 * BLOCK_D)
            m = mask_rows[:, None] & (ch < 2 * D_HALF)[None, :]
            x = tl.load(ptr + rows[:, None] * row_stride + ch[None, :] * d_stride, mask=m, other=0.0)
            even, odd = tl.split(tl.reshape(x, (BLOCK_N, BLOCK_D, 2)))
            return even.to(tl.float32), odd.to(tl.float32)
        else:
            base = ptr + rows[:, None] * row_stride
            m = mask_rows[:, None] & (d < D_HALF)[None, :]
            even = tl.load(base + (2 * d[None, :]) * d_stride, mask=m, other=0.0).to(tl.float32)
            odd = tl.load(base + (2 * d[None, :] + 1) * d_stride, mask=m, other=0.0).to(tl.float32)
            return even, odd

    @triton.jit
    def _store_halves(
        ptr, rows, row_stride, d_stride, mask_rows, D_HALF, even, odd, BLOCK_N, BLOCK_D, WIDE: tl.constexpr
    ):
        """Stores two (BLOCK_N, D/2) tiles as the even and odd channels of a (BLOCK_N, D) tile."""
        d = tl.arange(0, BLOCK_D)
        if WIDE:
            ch = tl.arange(0, 2 * BLOCK_D)
            m = mask_rows[:, None] & (ch < 2 * D_HALF)[None, :]
            x = tl.reshape(tl.join(even.to(ptr.dtype.element_ty), odd.to(ptr.dtype.element_ty)), (BLOCK_N, 2 * BLOCK_D))
            tl.store(ptr + rows[:, None] * row_stride + ch[None, :] * d_stride, x, mask=m)
        else:
            base = ptr + rows[:, None] * row_stride
            m = mask_rows[:, None] & (d < D_HALF)[None, :]
            tl.store(base + (2 * d[None, :]) * d_stride, even.to(ptr.dtype.element_ty), mask=m)
            tl.store(base + (2 * d[None, :] + 1) * d_stride, odd.to(ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _load_rope(COS, SIN, rows, row_stride, d_stride, mask_rows, D_HALF, BLOCK_N, BLOCK_D, WIDE: tl.constexpr):
        """cos and sin of each channel pair, (BLOCK_N, D/2) float32 each. WIDE (v2) reads the half-width
        tables the launcher prepared (cos at even, sin at odd channels: what the rotation uses), one
        contiguous tile each; v1 reads the full-width tables and drops half of what it read."""
        if WIDE:
            d = tl.arange(0, BLOCK_D)
            m = mask_rows[:, None] & (d < D_HALF)[None, :]
            offsets = rows[:, None] * row_stride + d[None, :] * d_stride
            c = tl.load(COS + offsets, mask=m, other=0.0).to(tl.float32)
            return c, tl.load(SIN + offsets, mask=m, other=0.0).to(tl.float32)
        else:
            c, _ = _load_halves(COS, rows, row_stride, d_stride, mask_rows, D_HALF, BLOCK_N, BLOCK_D, False)
            _, s = _load_halves(SIN, rows, row_stride, d_stride, mask_rows, D_HALF, BLOCK_N, BLOCK_D, False)
            return c, s

    @triton.jit
    def _program(H, M, SHARED: tl.constexpr):
        """(b, h, block) of this program, and the int64 offset of its (batch x head, block) summary row
        (the block's own, or row 0 when all blocks share one summary: linear attention). Offsets that
        grow with the batch are int64: B*N*H*D and B*H*M*D*E can pass 2^31; the in-sample offsets
        (token x stride) stay int32, which the launcher checks."""
        bh = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        if SHARED:
            row = bh
        else:
            row = bh * M + blk
        return bh // H, bh % H, blk, bh, row

    @triton.jit
    def _mixed_summary(
        S,
        Z,
        MIX,
        smix_h,
        smix_r,
        smix_c,
        bh,
        h,
        blk,
        row,
        M,
        D_HALF,
        E,
        BLOCK_D: tl.constexpr,
        BLOCK_E: tl.constexpr,
        NORMALIZE: tl.constexpr,
        SHARED: tl.constexpr,
        MIX_IN: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ):
        """The summary a program multiplies by: even and odd halves ``(BLOCK_D, BLOCK_E)`` in DOT_DTYPE, and the
        normalizer sums ``(BLOCK_D,)`` float32 (zeros without the normalizer).

        Without MIX_IN, row ``row`` of S and Z, mixed beforehand (``m @ S`` by torch). With MIX_IN, mixed here:
        ``sum_b w_b S[bh, b]`` over the M rows of this (batch, head), ``w_b = MIX[h * smix_h + blk * smix_r +
        b * smix_c]`` in float32 (1 when SHARED: the plain sum), accumulated in float32 and rounded once; this
        saves the mixing's own launches where every program reading all M summaries costs little (small M,
        see ``triton_ops.MIX_IN_KERNEL_BYTES``)."""
        d = tl.arange(0, BLOCK_D)
        e = tl.arange(0, BLOCK_E)
        md = d < D_HALF
        ms = md[:, None] & (e < E)[None, :]
        tile = d[:, None] * E + e[None, :]
        if MIX_IN:
            s_e = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)
            s_o = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)
            z_e = tl.zeros((BLOCK_D,), dtype=tl.float32)
            z_o = tl.zeros((BLOCK_D,), dtype=tl.float32)
            wp = MIX + h * smix_h + blk * smix_r
            for b in range(0, M):
                if SHARED:
                    w = 1.0
                else:
                    w = tl.load(wp + b * smix_c)
                sp = S + (bh * M + b) * (2 * D_HALF * E)
                s_e += w * tl.load(sp + tile, mask=ms, other=0.0).to(tl.float32)
                s_o += w * tl.load(sp + D_HALF * E + tile, mask=ms, other=0.0).to(tl.float32)
                if NORMALIZE:
                    zp = Z + (bh * M + b) * (2 * D_HALF)
                    z_e += w * tl.load(zp + d, mask=md, other=0.0)
                    z_o += w * tl.load(zp + D_HALF + d, mask=md, other=0.0)
            return s_e.to(DOT_DTYPE), s_o.to(DOT_DTYPE), z_e, z_o
        else:
            sp = S + row * (2 * D_HALF * E)
            s_e = tl.load(sp + tile, mask=ms, other=0.0).to(DOT_DTYPE)
            s_o = tl.load(sp + D_HALF * E + tile, mask=ms, other=0.0).to(DOT_DTYPE)
            if NORMALIZE:
                zp = Z + row * (2 * D_HALF)
                z_e = tl.load(zp + d, mask=md, other=0.0)
                z_o = tl.load(zp + D_HALF + d, mask=md, other=0.0)
            else:
                z_e = tl.zeros((BLOCK_D,), dtype=tl.float32)
                z_o = tl.zeros((BLOCK_D,), dtype=tl.float32)
            return s_e, s_o, z_e, z_o

    @triton.jit
    def _summaries_kernel(
        K,
        V,
        COS,
        SIN,
        S,
        Z,
        sk_b,
        sk_n,
        sk_h,
        sk_d,
        sv_b,
        sv_n,
        sv_h,
        sv_d,
        sr_n,
        sr_d,
        B,
        N,
        H,
        GF,
        GH,
        GW,
        BF,
        BH,
        BW,
        M,
        D_HALF,
        E,
        FEATURE: tl.constexpr,
        USE_ROPE: tl.constexpr,
        NORMALIZE: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        b, h, blk, bh, row = _program(H, M, False)
        f0, h0, w0, lf, lh, lw = _block_geometry(blk, GF, GH, GW, BF, BH, BW)
        nb = lf * lh * lw
        d = tl.arange(0, BLOCK_D)
        e = tl.arange(0, BLOCK_E)
        md = d < D_HALF
        me = e < E
        acc_e = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)
        acc_o = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)
        if NORMALIZE:  # without the normalizer (Wan's setting) the key sums are not needed at all
            z_e = tl.zeros((BLOCK_D,), dtype=tl.float32)
            z_o = tl.zeros((BLOCK_D,), dtype=tl.float32)
        kp = K + b * sk_b + h * sk_h
        vp = V + b * sv_b + h * sv_h
        for start in range(0, nb, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            mj = j < nb
            n = _token_ids(j, f0, h0, w0, lh, lw, GH, GW)
            ke, ko = _load_halves(kp, n, sk_n, sk_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
            ke = tl.where(mj[:, None] & md[None, :], _phi(ke, FEATURE), 0.0)
            ko = tl.where(mj[:, None] & md[None, :], _phi(ko, FEATURE), 0.0)
            if NORMALIZE:
                z_e += tl.sum(ke, axis=0)
                z_o += tl.sum(ko, axis=0)
            if USE_ROPE:
                c, s = _load_rope(COS, SIN, n, sr_n, sr_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
                ke, ko = ke * c - ko * s, ke * s + ko * c
            v = tl.load(vp + n[:, None] * sv_n + e[None, :] * sv_d, mask=mj[:, None] & me[None, :], other=0.0)
            v = v.to(DOT_DTYPE)
            acc_e += tl.dot(tl.trans(ke.to(DOT_DTYPE)), v, input_precision=PRECISION)
            acc_o += tl.dot(tl.trans(ko.to(DOT_DTYPE)), v, input_precision=PRECISION)
        # S: (B*H, M, 2*D_HALF, E) contiguous, even channels first; Z: (B*H, M, 2*D_HALF)
        sp = S + row * (2 * D_HALF * E)
        ms = md[:, None] & me[None, :]
        tl.store(sp + d[:, None] * E + e[None, :], acc_e.to(S.dtype.element_ty), mask=ms)
        tl.store(sp + (D_HALF + d[:, None]) * E + e[None, :], acc_o.to(S.dtype.element_ty), mask=ms)
        if NORMALIZE:
            zp = Z + row * (2 * D_HALF)
            tl.store(zp + d, z_e, mask=md)
            tl.store(zp + D_HALF + d, z_o, mask=md)

    @triton.jit
    def _output_kernel(
        Q,
        COS,
        SIN,
        S,
        Z,
        MIX,
        OUT,
        DEN,
        sq_b,
        sq_n,
        sq_h,
        sq_d,
        so_b,
        so_n,
        so_h,
        so_d,
        sr_n,
        sr_d,
        smix_h,
        smix_r,
        smix_c,
        B,
        N,
        H,
        GF,
        GH,
        GW,
        BF,
        BH,
        BW,
        M,
        D_HALF,
        E,
        eps,
        FEATURE: tl.constexpr,
        USE_ROPE: tl.constexpr,
        NORMALIZE: tl.constexpr,
        SHARED: tl.constexpr,
        MIX_IN: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        b, h, blk, bh, row = _program(H, M, SHARED)
        f0, h0, w0, lf, lh, lw = _block_geometry(blk, GF, GH, GW, BF, BH, BW)
        nb = lf * lh * lw
        d = tl.arange(0, BLOCK_D)
        e = tl.arange(0, BLOCK_E)
        md = d < D_HALF
        me = e < E
        # the block's mixed summary is read (or mixed) once and kept for all its tokens
        s_e, s_o, z_e, z_o = _mixed_summary(
            S, Z, MIX, smix_h, smix_r, smix_c, bh, h, blk, row, M, D_HALF, E,
            BLOCK_D, BLOCK_E, NORMALIZE, SHARED, MIX_IN, DOT_DTYPE,
        )  # fmt: skip
        qp = Q + b * sq_b + h * sq_h
        op = OUT + b * so_b + h * so_h
        for start in range(0, nb, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            mj = j < nb
            n = _token_ids(j, f0, h0, w0, lh, lw, GH, GW)
            qe, qo = _load_halves(qp, n, sq_n, sq_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
            qe = tl.where(md[None, :], _phi(qe, FEATURE), 0.0)
            qo = tl.where(md[None, :], _phi(qo, FEATURE), 0.0)
            if NORMALIZE:
                den = tl.sum(qe * z_e[None, :], axis=1) + tl.sum(qo * z_o[None, :], axis=1) + eps
            if USE_ROPE:
                c, s = _load_rope(COS, SIN, n, sr_n, sr_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
                qe, qo = qe * c - qo * s, qe * s + qo * c
            out = tl.dot(qe.to(DOT_DTYPE), s_e, input_precision=PRECISION)
            out += tl.dot(qo.to(DOT_DTYPE), s_o, input_precision=PRECISION)
            if NORMALIZE:
                out = out / den[:, None]
                tl.store(DEN + bh * N + n, den, mask=mj)
            tl.store(
                op + n[:, None] * so_n + e[None, :] * so_d, out.to(OUT.dtype.element_ty), mask=mj[:, None] & me[None, :]
            )

    @triton.jit
    def _backward_query_kernel(
        Q,
        DO,
        COS,
        SIN,
        S,
        Z,
        MIX,
        DEN,
        DQ,
        DS,
        DZ,
        sq_b,
        sq_n,
        sq_h,
        sq_d,
        sg_b,
        sg_n,
        sg_h,
        sg_d,
        sdq_b,
        sdq_n,
        sdq_h,
        sdq_d,
        sr_n,
        sr_d,
        smix_h,
        smix_r,
        smix_c,
        B,
        N,
        H,
        GF,
        GH,
        GW,
        BF,
        BH,
        BW,
        M,
        D_HALF,
        E,
        FEATURE: tl.constexpr,
        USE_ROPE: tl.constexpr,
        NORMALIZE: tl.constexpr,
        SHARED: tl.constexpr,
        MIX_IN: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """dq for the block's query tokens, and dS~_i = sum rq^T dnum, dz~_i = sum dden phi(q)."""
        b, h, blk, bh, row = _program(H, M, SHARED)
        own = bh * M + blk  # dS~, dz~ are per query block even when the summary is shared
        f0, h0, w0, lf, lh, lw = _block_geometry(blk, GF, GH, GW, BF, BH, BW)
        nb = lf * lh * lw
        d = tl.arange(0, BLOCK_D)
        e = tl.arange(0, BLOCK_E)
        md = d < D_HALF
        me = e < E
        ms = md[:, None] & me[None, :]
        s_e, s_o, z_e, z_o = _mixed_summary(
            S, Z, MIX, smix_h, smix_r, smix_c, bh, h, blk, row, M, D_HALF, E,
            BLOCK_D, BLOCK_E, NORMALIZE, SHARED, MIX_IN, DOT_DTYPE,
        )  # fmt: skip
        if NORMALIZE:
            dz_e = tl.zeros((BLOCK_D,), dtype=tl.float32)
            dz_o = tl.zeros((BLOCK_D,), dtype=tl.float32)
        ds_e = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)
        ds_o = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)
        qp = Q + b * sq_b + h * sq_h
        gp = DO + b * sg_b + h * sg_h
        dqp = DQ + b * sdq_b + h * sdq_h
        for start in range(0, nb, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            mj = j < nb
            n = _token_ids(j, f0, h0, w0, lh, lw, GH, GW)
            xe, xo = _load_halves(qp, n, sq_n, sq_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
            fe = tl.where(mj[:, None] & md[None, :], _phi(xe, FEATURE), 0.0)
            fo = tl.where(mj[:, None] & md[None, :], _phi(xo, FEATURE), 0.0)
            g = tl.load(gp + n[:, None] * sg_n + e[None, :] * sg_d, mask=mj[:, None] & me[None, :], other=0.0)
            g = g.to(tl.float32)
            if USE_ROPE:
                c, s = _load_rope(COS, SIN, n, sr_n, sr_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
                re, ro = fe * c - fo * s, fe * s + fo * c
            else:
                re, ro = fe, fo
            if NORMALIZE:
                den = tl.load(DEN + bh * N + n, mask=mj, other=1.0)
                num_e = tl.dot(re.to(DOT_DTYPE), s_e, input_precision=PRECISION)
                num = num_e + tl.dot(ro.to(DOT_DTYPE), s_o, input_precision=PRECISION)
                dnum = g / den[:, None]
                dden = -tl.sum(dnum * num, axis=1) / den  # -(g . num) / den^2
                dz_e += tl.sum(fe * dden[:, None], axis=0)
                dz_o += tl.sum(fo * dden[:, None], axis=0)
            else:
                dnum = g
            dnum_c = dnum.to(DOT_DTYPE)
            ds_e += tl.dot(tl.trans(re.to(DOT_DTYPE)), dnum_c, input_precision=PRECISION)
            ds_o += tl.dot(tl.trans(ro.to(DOT_DTYPE)), dnum_c, input_precision=PRECISION)
            dre = tl.dot(dnum_c, tl.trans(s_e), input_precision=PRECISION)
            dro = tl.dot(dnum_c, tl.trans(s_o), input_precision=PRECISION)
            if USE_ROPE:  # the rotation's transpose
                dfe, dfo = dre * c + dro * s, dro * c - dre * s
            else:
                dfe, dfo = dre, dro
            if NORMALIZE:
                dfe += dden[:, None] * z_e[None, :]
                dfo += dden[:, None] * z_o[None, :]
            dqe = dfe * _dphi(xe, FEATURE)
            dqo = dfo * _dphi(xo, FEATURE)
            _store_halves(dqp, n, sdq_n, sdq_d, mj, D_HALF, dqe, dqo, BLOCK_N, BLOCK_D, WIDE)
        dsp = DS + own * (2 * D_HALF * E)
        tl.store(dsp + d[:, None] * E + e[None, :], ds_e.to(DS.dtype.element_ty), mask=ms)
        tl.store(dsp + (D_HALF + d[:, None]) * E + e[None, :], ds_o.to(DS.dtype.element_ty), mask=ms)
        if NORMALIZE:
            dzp = DZ + own * (2 * D_HALF)
            tl.store(dzp + d, dz_e, mask=md)
            tl.store(dzp + D_HALF + d, dz_o, mask=md)

    @triton.jit
    def _backward_key_kernel(
        K,
        V,
        COS,
        SIN,
        DS,
        DZ,
        MIX,
        DK,
        DV,
        sk_b,
        sk_n,
        sk_h,
        sk_d,
        sv_b,
        sv_n,
        sv_h,
        sv_d,
        sdk_b,
        sdk_n,
        sdk_h,
        sdk_d,
        sdv_b,
        sdv_n,
        sdv_h,
        sdv_d,
        sr_n,
        sr_d,
        smix_h,
        smix_r,
        smix_c,
        B,
        N,
        H,
        GF,
        GH,
        GW,
        BF,
        BH,
        BW,
        M,
        D_HALF,
        E,
        FEATURE: tl.constexpr,
        USE_ROPE: tl.constexpr,
        NORMALIZE: tl.constexpr,
        SHARED: tl.constexpr,
        MIX_IN: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """dk, dv for the block's key tokens from dS_b = (m^T dS~)_b and dz_b (with MIX_IN that sum over the
        query blocks' dS~_i is formed here: the launcher passes the mixing's strides transposed)."""
        b, h, blk, bh, row = _program(H, M, SHARED)
        f0, h0, w0, lf, lh, lw = _block_geometry(blk, GF, GH, GW, BF, BH, BW)
        nb = lf * lh * lw
        d = tl.arange(0, BLOCK_D)
        e = tl.arange(0, BLOCK_E)
        md = d < D_HALF
        me = e < E
        ds_e, ds_o, dz_e, dz_o = _mixed_summary(
            DS, DZ, MIX, smix_h, smix_r, smix_c, bh, h, blk, row, M, D_HALF, E,
            BLOCK_D, BLOCK_E, NORMALIZE, SHARED, MIX_IN, DOT_DTYPE,
        )  # fmt: skip
        kp = K + b * sk_b + h * sk_h
        vp = V + b * sv_b + h * sv_h
        dkp = DK + b * sdk_b + h * sdk_h
        dvp = DV + b * sdv_b + h * sdv_h
        for start in range(0, nb, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            mj = j < nb
            n = _token_ids(j, f0, h0, w0, lh, lw, GH, GW)
            xe, xo = _load_halves(kp, n, sk_n, sk_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
            fe = tl.where(md[None, :], _phi(xe, FEATURE), 0.0)
            fo = tl.where(md[None, :], _phi(xo, FEATURE), 0.0)
            if USE_ROPE:
                c, s = _load_rope(COS, SIN, n, sr_n, sr_d, mj, D_HALF, BLOCK_N, BLOCK_D, WIDE)
                re, ro = fe * c - fo * s, fe * s + fo * c
            else:
                re, ro = fe, fo
            v = tl.load(vp + n[:, None] * sv_n + e[None, :] * sv_d, mask=mj[:, None] & me[None, :], other=0.0)
            v = v.to(DOT_DTYPE)
            dv = tl.dot(re.to(DOT_DTYPE), ds_e, input_precision=PRECISION)
            dv += tl.dot(ro.to(DOT_DTYPE), ds_o, input_precision=PRECISION)
            tl.store(
                dvp + n[:, None] * sdv_n + e[None, :] * sdv_d,
                dv.to(DV.dtype.element_ty),
                mask=mj[:, None] & me[None, :],
            )
            dre = tl.dot(v, tl.trans(ds_e), input_precision=PRECISION)
            dro = tl.dot(v, tl.trans(ds_o), input_precision=PRECISION)
            if USE_ROPE:
                dfe, dfo = dre * c + dro * s, dro * c - dre * s
            else:
                dfe, dfo = dre, dro
            if NORMALIZE:
                dfe += dz_e[None, :]
                dfo += dz_o[None, :]
            dke, dko = dfe * _dphi(xe, FEATURE), dfo * _dphi(xo, FEATURE)
            _store_halves(dkp, n, sdk_n, sdk_d, mj, D_HALF, dke, dko, BLOCK_N, BLOCK_D, WIDE)

    @triton.jit
    def _mixing_kernel(
        S,
        MIX,
        OUT,
        smix_h,
        smix_r,
        smix_c,
        H,
        M,
        COLS,
        SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
        ROUND_BITS: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """``OUT[bh, i, c] = sum_b w_ib S[bh, b, c]``, ``w_ib = MIX[h * smix_h + i * smix_r + b * smix_c]`` float32:
        the mixing of M block summaries (each COLS values, rows of S and OUT contiguous) for one (batch x head),
        BLOCK_I output rows and BLOCK_N columns per program, accumulated in float32 and rounded once.

        SPLIT (bf16 S): the float32 coefficients enter the tensor-core products as bf16 ``hi + lo`` (16
        significant bits together; rounding them to bf16 would cost 0.4% each), both products accumulated in
        one float32 tile: what two torch products (``bmm`` then ``baddbmm``) did with a launch and a round trip
        of the result through memory more. Otherwise float32 operands at ``PRECISION``. ROUND_BITS (Triton's
        interpreter, whose float32 -> bf16 conversion truncates): rounded to nearest even on the bits first, as a
        GPU's conversion does, so that a CPU test sees the rounding the GPU makes."""
        bh = tl.program_id(0).to(tl.int64)
        h = bh % H
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        c = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        mi = i < M
        mc = c < COLS
        acc = tl.zeros((BLOCK_I, BLOCK_N), dtype=tl.float32)
        wp = MIX + h * smix_h + i[:, None] * smix_r
        sp = S + bh * M * COLS + c[None, :]
        for b0 in range(0, M, BLOCK_B):
            bb = b0 + tl.arange(0, BLOCK_B)
            mb = bb < M
            w = tl.load(wp + bb[None, :] * smix_c, mask=mi[:, None] & mb[None, :], other=0.0)
            x = tl.load(sp + bb[:, None] * COLS, mask=mb[:, None] & mc[None, :], other=0.0)
            if SPLIT:
                hi = w.to(tl.bfloat16)
                lo = (w - hi.to(tl.float32)).to(tl.bfloat16)
                acc += tl.dot(hi, x)
                acc += tl.dot(lo, x)
            else:
                acc += tl.dot(w, x.to(tl.float32), input_precision=PRECISION)
        if ROUND_BITS:
            bits = acc.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            acc = bits.to(tl.float32, bitcast=True)
        op = OUT + bh * M * COLS + i[:, None] * COLS + c[None, :]
        tl.store(op, acc.to(OUT.dtype.element_ty), mask=mi[:, None] & mc[None, :])

    KERNELS = dict(zip(KERNEL_NAMES, (_summaries_kernel, _output_kernel, _backward_query_kernel, _backward_key_kernel)))
    MIXING_KERNEL = _mixing_kernel
else:
    KERNELS = {}
    MIXING_KERNEL = None
