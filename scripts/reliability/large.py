"""Large inputs (scripts/gpu_reliability.sh, step ``large``), each checked against float64 on
sampled positions, never a dense reference:

* ``linear_scan`` with more than 2^31 elements per tensor (bfloat16): sampled rows, the last one
  past element 2^31, against the blocked float64 scan of tests/test_linear_scan.py, forward and
  every gradient;
* ``ssd_chunk_scan`` and ``bidirectional_chunk_scan`` at 1,048,576 tokens (batch 1, 8 heads,
  headdim 64, dstate 128, decays from 1e-5 to 2, so states carry across the whole sequence): on a
  few windows, outputs and the gradients of x, dt, B, C. A window [s, e) is exact in float64 with
  two boundary terms, each one reduction over the rest of the sequence: the state entering it,
  h_s = sum_{k<s} exp(a_{s-1} - a_k) dt_k x_k B_k^T, and the adjoint of the state leaving it,
  lambda = sum_{t>=e} exp(a_t - a_{e-1}) g_t C_t^T, so that the loss <y, g> restricted to what the
  window's inputs change is <y_window, g_window> + <h_{e-1}, lambda>, with y_window and h_{e-1}
  from the quadratic reference started at h_s. The reverse direction is the same on the flipped
  sequence;
* ``attention`` at N = 131072 (batch 1, 4 heads, head dim 64, causal, bfloat16): sampled query
  rows (out, lse, dq) and key rows (dk, dv) against a float64 pass over all keys, with the tests'
  rule (at most 2x the error of the same computation in bfloat16).

``--smoke`` runs the same checks at a few hundred positions (the CPU test).

    python scripts/reliability/large.py --checks linear_scan,ssd_chunk_scan --json out.json
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import blocked_reference  # noqa: E402  (tests/test_linear_scan.py's float64 scan of long rows)
from cli import comma_list, write_report  # noqa: E402
from mamba_annotated import attention, bidirectional_chunk_scan, linear_scan, ssd_chunk_scan  # noqa: E402
from mamba_annotated.runtime import DEVICE  # noqa: E402
from mamba_annotated.ssd.reference import per_head, process_dt, ssd_quadratic_ref  # noqa: E402
from mamba_annotated.testing import (assert_within_same_computation, randn, rel_error, seed_everything,  # noqa: E402
                                     tolerance, uniform)

CHECKS = ("linear_scan", "ssd_chunk_scan", "bidirectional_chunk_scan", "attention")
GPU = dict(scan_rows=2049, scan_length=(1 << 20) + 3, scan_block=1024, tokens=1 << 20, window=384, chunk=256,
           headdim=64, dstate=128, heads=8, attention_n=1 << 17, attention_heads=4, block=1 << 16)
SMOKE = dict(scan_rows=3, scan_length=300, scan_block=64, tokens=300, window=40, chunk=32, headdim=16, dstate=16,
             heads=2, attention_n=150, attention_heads=2, block=64)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--smoke", action="store_true", help="the same checks at a few hundred positions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.checks = comma_list(parser, args.checks, CHECKS, "--checks")
    return args


def judge(errors, name, out, ref, tol):
    err = rel_error(out, ref)
    errors[name] = err
    return [] if err < tol else [f"{name}: relative error {err:.3e} not below {tol:.0e}"]


# ---------------------------------------------------------------- linear_scan past 2^31 elements


def check_linear_scan(sizes):
    rows, length, dtype = sizes["scan_rows"], sizes["scan_length"], torch.bfloat16
    a = uniform(rows, length, low=0.6, high=1.0, dtype=dtype).requires_grad_()
    b = randn(rows, length, dtype=dtype).requires_grad_()
    h0 = randn(rows).requires_grad_()
    grad_h = randn(rows, length, dtype=dtype)
    h = linear_scan(a, b, h0=h0)
    grad_a, grad_b, grad_h0 = torch.autograd.grad(h, (a, b, h0), grad_h)
    sampled = sorted({0, rows // 2, rows - 1})
    leaves = [t.detach()[sampled].double().requires_grad_() for t in (a, b, h0)]
    ref = blocked_reference(*leaves, False, block=sizes["scan_block"])
    want = torch.autograd.grad(ref, leaves, grad_h[sampled].double())
    errors, tol = {}, tolerance(dtype)
    failures = judge(errors, "h", h.detach()[sampled], ref, tol)
    for name, got, w in zip(("a", "b", "h0"), (grad_a, grad_b, grad_h0), want):
        failures += judge(errors, f"grad {name}", got[sampled], w, tol)
    return dict(size=f"({rows}, {length}) bfloat16, {a.numel()} elements (2^31 = {1 << 31})", rows_checked=sampled,
                errors=errors, failures=failures)


# ---------------------------------------------------------------- SSD and bidirectional windows


def boundary_terms(x, dt, A, B, C, g, dt_bias, start, end, block):
    """(h_start, lambda): the float64 state entering [start, end) and the adjoint of the state
    leaving it (see the module), each one reduction over the positions outside, in blocks."""
    batch, length, heads, headdim = x.shape
    step = process_dt(dt, dt_bias, True)
    a = torch.cumsum(step * A.double(), dim=1)
    h_in = torch.zeros(batch, heads, headdim, B.shape[-1], dtype=torch.float64, device=x.device)
    lam = torch.zeros_like(h_in)
    for s in range(0, start, block):
        e = min(s + block, start)
        w = torch.exp(a[:, start - 1:start] - a[:, s:e]) * step[:, s:e]
        h_in += torch.einsum("bsh,bshp,bshn->bhpn", w, x[:, s:e].double(), per_head(B[:, s:e], heads))
    for s in range(end, length, block):
        e = min(s + block, length)
        w = torch.exp(a[:, s:e] - a[:, end - 1:end])
        lam += torch.einsum("bth,bthp,bthn->bhpn", w, g[:, s:e].double(), per_head(C[:, s:e], heads))
    return h_in, lam


def window_reference(inputs, g, start, end, bidirectional, block):
    """Float64 y on [start, end) and the gradients of x, dt, B, C there (exact for the whole loss)."""
    length = inputs["x"].shape[1]
    leaves = {k: inputs[k][:, start:end].detach().double().requires_grad_() for k in ("x", "dt", "B", "C")}
    directions = [(lambda t: t, start, end)]
    if bidirectional:
        directions.append((lambda t: t.flip(1), length - end, length - start))
    y, extra = 0.0, 0.0
    for orient, s, e in directions:
        full = {k: orient(inputs[k]) for k in ("x", "dt", "B", "C")}
        h_in, lam = boundary_terms(full["x"], full["dt"], inputs["A"], full["B"], full["C"], orient(g),
                                   inputs["dt_bias"], s, e, block)
        w = {k: orient(v) for k, v in leaves.items()}
        part, final = ssd_quadratic_ref(w["x"], w["dt"], inputs["A"], w["B"], w["C"], dt_bias=inputs["dt_bias"],
                                        dt_softplus=True, initial_states=h_in, return_final_states=True)
        y, extra = y + orient(part), extra + (final * lam).sum()
    y = y + inputs["D"].double()[:, None] * leaves["x"]
    loss = (y * g[:, start:end].double()).sum() + extra
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y.detach(), dict(zip(leaves, grads))


def check_chunked(sizes, bidirectional):
    length, heads, dtype, chunk = sizes["tokens"], sizes["heads"], torch.bfloat16, sizes["chunk"]
    log_decay = torch.empty(heads).uniform_(-5.0, 0.3).exp().to(DEVICE)  # |A| from 1e-5 to 2
    inputs = dict(x=randn(1, length, heads, sizes["headdim"], dtype=dtype), dt=uniform(1, length, heads, low=-3.0,
                  high=0.5), A=-log_decay, B=randn(1, length, 1, sizes["dstate"], dtype=dtype),
                  C=randn(1, length, 1, sizes["dstate"], dtype=dtype), D=randn(heads), dt_bias=randn(heads, scale=0.5))
    leaves = {k: v.requires_grad_() for k, v in inputs.items()}
    fn = bidirectional_chunk_scan if bidirectional else ssd_chunk_scan
    out = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk, D=leaves["D"],
             dt_bias=leaves["dt_bias"], dt_softplus=True)
    g = randn(*out.shape, dtype=dtype)
    grads = dict(zip(("x", "dt", "B", "C"), torch.autograd.grad(out, [leaves[k] for k in ("x", "dt", "B", "C")], g)))
    window = sizes["window"]
    starts = sorted({0, chunk - 5, length // 2 - window // 2, length - window})
    errors, failures, tol = {}, [], tolerance(dtype)
    for s in starts:
        y_ref, grads_ref = window_reference(inputs, g, s, s + window, bidirectional, sizes["block"])
        failures += judge(errors, f"out[{s}:{s + window}]", out.detach()[:, s:s + window], y_ref, tol)
        for name in grads_ref:
            failures += judge(errors, f"grad {name}[{s}:{s + window}]", grads[name][:, s:s + window], grads_ref[name],
                              tol)
    return dict(size=f"batch 1, {length} tokens, {heads} heads, headdim {sizes['headdim']}, dstate {sizes['dstate']}, "
                     f"chunk {chunk}, bfloat16", windows=[[s, s + window] for s in starts], errors=errors,
                failures=failures)


# ---------------------------------------------------------------- attention


def sampled_attention(q, k, v, g, rows, keys, scale, dtype, block):
    """Causal attention of (1, N, heads, d) tensors computed in ``dtype`` over all keys, in row
    blocks: out, lse and dq of the sampled query rows, dk and dv of the sampled key rows."""
    q, k, v, g = (t[0].transpose(0, 1).to(dtype) for t in (q, k, v, g))   # (heads, N, d)
    heads, n, _ = q.shape
    lse = torch.empty(heads, n, dtype=torch.float32 if dtype != torch.float64 else dtype, device=q.device)
    out = torch.empty_like(q)
    for s in range(0, n, block):
        e = min(s + block, n)
        scores = scale * (q[:, s:e] @ k[:, :e].transpose(1, 2))
        mask = torch.arange(e, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        lse[:, s:e] = torch.logsumexp(scores.to(lse.dtype), dim=-1)
        out[:, s:e] = torch.softmax(scores, dim=-1) @ v[:, :e]
    delta = (g.to(lse.dtype) * out.to(lse.dtype)).sum(-1)                # (heads, N)

    def probs(r, c):  # P[r, c] for rows r and columns c, causal
        p = torch.exp((scale * (q[:, r] @ k[:, c].transpose(1, 2))).to(lse.dtype) - lse[:, r, None])
        return p.masked_fill(c[None, None, :] > r[None, :, None], 0.0)

    everyone = torch.arange(n, device=q.device)
    p_rows = probs(rows, everyone)                                         # (heads, rows, N)
    ds_rows = p_rows * ((g[:, rows] @ v.transpose(1, 2)).to(lse.dtype) - delta[:, rows, None])
    dq = scale * (ds_rows.to(dtype) @ k)
    p_cols = probs(everyone, keys)                                         # (heads, N, keys)
    dp_cols = (g @ v[:, keys].transpose(1, 2)).to(lse.dtype)
    ds_cols = p_cols * (dp_cols - delta[:, :, None])
    dk = scale * (ds_cols.transpose(1, 2).to(dtype) @ q)
    dv = p_cols.transpose(1, 2).to(dtype) @ g
    return dict(out=out[:, rows], lse=lse[:, rows], dq=dq, dk=dk, dv=dv)


def check_attention(sizes):
    n, heads, dtype = sizes["attention_n"], sizes["attention_heads"], torch.bfloat16
    q, k, v = (randn(1, n, heads, 64, dtype=dtype).requires_grad_() for _ in range(3))
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    g = randn(*out.shape, dtype=dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    rows = torch.tensor(sorted({0, 1, 127, 128, n // 2, n - 2, n - 1}), device=DEVICE)
    keys = rows.clone()
    scale = 64 ** -0.5
    block = min(1024, n)
    want = sampled_attention(q.detach(), k.detach(), v.detach(), g, rows, keys, scale, torch.float64, block)
    same = sampled_attention(q.detach(), k.detach(), v.detach(), g, rows, keys, scale, dtype, block)
    ours = dict(out=out.detach()[0, rows].transpose(0, 1), lse=lse[0][:, rows], dq=dq[0, rows].transpose(0, 1),
                dk=dk[0, keys].transpose(0, 1), dv=dv[0, keys].transpose(0, 1))
    errors, failures = {}, []
    for name in ours:
        try:
            errors[name], _ = assert_within_same_computation(name, ours[name], same[name], want[name], dtype)
        except AssertionError as e:
            failures.append(str(e))
    return dict(size=f"batch 1, N = {n}, {heads} heads, head dim 64, causal, bfloat16", rows_checked=rows.tolist(),
                errors=errors, failures=failures)


def main(argv=None):
    args = parse_args(argv)
    if DEVICE.type != "cuda" and not args.smoke:
        print("large: skipped (needs a CUDA device; --smoke runs the checks at small sizes)")
        return 0
    sizes = SMOKE if args.smoke else GPU
    runs = {"linear_scan": lambda: check_linear_scan(sizes),
            "ssd_chunk_scan": lambda: check_chunked(sizes, bidirectional=False),
            "bidirectional_chunk_scan": lambda: check_chunked(sizes, bidirectional=True),
            "attention": lambda: check_attention(sizes)}
    report, failed = {}, False
    for name in args.checks:
        seed_everything(0)
        start = time.monotonic()
        try:
            r = runs[name]()
        except Exception as e:
            r = dict(failures=[f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"])
        r["seconds"] = round(time.monotonic() - start, 1)
        report[name] = r
        failed |= bool(r["failures"])
        print(f"large {name}: {r.get('size', '')}: {'; '.join(r['failures']) or 'pass'} ({r['seconds']} s)", flush=True)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    write_report(args.json, "large", report, smoke=args.smoke)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
