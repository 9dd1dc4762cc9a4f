"""Where SSD sweep seed 71461 lost digits (float32, L = 2039 = 7 x 256 + 247, chunk 256; a GPU
regression test in tests/test_reliability_smoke.py since the chunk sums keep their low part): for
chunk sizes 256, 128, 64 and 16 on the case's inputs, against float64,

* our op's outputs and gradients (the sweep's verdict),
* the states entering each chunk (``ssd_forward``'s saved H_c against ``ssd_chunked_ref``'s), and
  the largest error of the chunk cumulative sums of dt A beside their largest size,
* the final state of the same chunked algorithm written in float32 PyTorch (cumulative sums added
  in order),
* how far the chunk's last exponents a_last - a_t (its last 9 positions) are from float64 and
  how far the last slot of the last chunk is from its last position's sum,
* our op's final state with the cumulative sums replaced by float64 ones rounded once to float32
  (everything else ours),
* mamba_ssm's ``mamba_chunk_scan_combined`` with exact float32 dots (``TRITON_F32_DEFAULT=ieee``,
  which ``main`` sets before any kernel compiles; our kernels name their precision and do not read
  it), where mamba_ssm is importable.

    python scripts/reliability/float32_final_state.py --json out.json

book/data/reliability_float32_final_state.json holds H100 runs (2026-11-27). With float32 chunk
sums: ours 2.7e-5 on the final state where the chunks' entering states, the float32 algorithm and
mamba_ssm give 4.5e-6, and 4.4e-6 from the same kernels fed correctly rounded chunk sums. With the
sums kept in float64 (``float64_sums``): ours 4.5e-8; as two float32 planes (``planes``): 8.0e-8
(README, "What 71461 was").
"""
import argparse
import copy
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402
from cases import as64, both_gradients  # noqa: E402
from cli import write_report  # noqa: E402
from mamba_annotated.ssd import forward as forward_module  # noqa: E402
from mamba_annotated.ssd.chunk_cumsum import chunk_cumsum  # noqa: E402
from mamba_annotated.ssd.forward import ssd_forward  # noqa: E402
from mamba_annotated.ssd.log_decays import natural_sums  # noqa: E402
from mamba_annotated.triton_ops import LOG2E  # noqa: E402
from mamba_annotated.ssd.reference import ssd_chunked_ref, ssd_quadratic_ref  # noqa: E402
from mamba_annotated.testing import rel_error, seed_everything  # noqa: E402
from test_reliability_smoke import PASSING_GPU_SWEEP_CASES  # noqa: E402  (cases put tests/ on the path)
from test_ssd import mamba_ssm_combined  # noqa: E402

CHUNKS = (256, 128, 64, 16)


def chunked_final_state(x, dt, A, B, chunk, dtype):
    """The final state of the chunked algorithm in ``dtype`` PyTorch, for the case's options
    (softplus, one group, no initial state): per chunk a = cumsum(dt A), S = sum_t exp(a_last - a_t)
    dt_t x_t B_t^T, H <- exp(a_last) H + S."""
    x, B, A = x.to(dtype), B.to(dtype), A.to(dtype)
    dt = F.softplus(dt.to(dtype))
    batch, length, heads, headdim = x.shape
    H = torch.zeros(batch, heads, headdim, B.shape[-1], dtype=dtype, device=x.device)
    for start in range(0, length, chunk):
        step = dt[:, start:start + chunk]
        a = torch.cumsum(step * A, dim=1)
        weight = torch.exp(a[:, -1:] - a) * step
        S = torch.einsum("bsh,bshp,bshn->bhpn", weight, x[:, start:start + chunk],
                         B[:, start:start + chunk].expand(-1, -1, heads, -1))
        H = torch.exp(a[:, -1])[..., None, None] * H + S
    return H


def correctly_rounded_cumsums(dt, A, chunk_size, **options):
    """chunk_cumsum with each a_t summed in float64 and rounded once to float32, the low part
    dropped (the planes' lo 0 but for the rounding of the scaling by log2(e))."""
    _, dt_out = chunk_cumsum(dt, A, chunk_size, **options)
    rounded = torch.cumsum(dt_out.double() * A.double()[None, :, None, None], dim=-1).float().double()
    scaled = rounded * LOG2E.value
    hi = scaled.float()
    return torch.stack([hi, (scaled - hi.double()).float()], dim=3), dt_out


def last_exponents_error(ours, exact, length):
    """The largest error of a_last - a_t over the last chunk's last 9 positions, and its last slot
    less its last position (0 where the sums past the end are the last position's)."""
    last = (length - 1) % ours.shape[-1]
    first = max(last - 8, 0)
    differences = [(a[..., -1, last:last + 1] - a[..., -1, first:last + 1]).double() for a in (ours, exact)]
    past_the_end = (ours[..., -1, -1] - ours[..., -1, last]).abs().max().item()
    return (differences[0] - differences[1]).abs().max().item(), past_the_end


def errors_of(fn, ref_fn, args, args64, seed):
    """Relative errors of y, the final state and every gradient of ``fn`` against float64."""
    with torch.no_grad():
        got, want = fn(**args), ref_fn(**args64)
    ours, ref = both_gradients(fn, ref_fn, args, args64, seed, got)
    return dict(y=rel_error(got[0], want[0]), final_states=rel_error(got[1], want[1]),
                **{f"grad {k}": rel_error(ours[k], ref[k]) for k in ref})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # read by Triton when a kernel compiles
    name, seed, params = PASSING_GPU_SWEEP_CASES["ssd_float32_final_state_at_chunk256"]
    op, peer = cases.OPS[name], mamba_ssm_combined()
    report = {}
    for chunk in CHUNKS:
        params = copy.deepcopy(params)
        params["dims"]["chunk"] = chunk
        seed_everything(seed)
        leaves = op.inputs(params)
        views, views64 = op.views(params, leaves), op.views(params, as64(leaves))
        x, dt, A, B, C, D = (views[k].detach() for k in ("x", "dt", "A", "B", "C", "D"))
        saved = ssd_forward(x, dt, A, B, C, chunk, D=D, dt_softplus=True).saved
        steps = ssd_chunked_ref(x, dt, A, B, C, chunk, D=D, dt_softplus=True, return_intermediates=True)[1]
        exact = chunked_final_state(x, dt, A, B, chunk, torch.float64)
        row = dict(ours=errors_of(op.ours(params), op.call(params, ssd_quadratic_ref), views, views64, seed),
                   states_in=rel_error(saved.states_in, steps["states_in"]),
                   cumsum_abs_error=(natural_sums(saved.dA_cumsum) - steps["dA_cumsum"]).abs().max().item(),
                   cumsum_largest=steps["dA_cumsum"].abs().max().item(),
                   float32_torch_final_state=rel_error(chunked_final_state(x, dt, A, B, chunk, torch.float32), exact))
        row["last_exponents_abs_error"], row["last_slot_less_last_position"] = last_exponents_error(
            natural_sums(saved.dA_cumsum), steps["dA_cumsum"], x.shape[1])
        with mock.patch.object(forward_module, "chunk_cumsum", correctly_rounded_cumsums), torch.no_grad():
            final = op.ours(params)(**views)[1]
        row["final_state_with_correctly_rounded_cumsums"] = rel_error(
            final, op.call(params, ssd_quadratic_ref)(**views64)[1])
        if peer is not None:
            row["mamba_ssm_exact_float32"] = errors_of(op.call(params, peer.mamba_chunk_scan_combined),
                                                       op.call(params, ssd_quadratic_ref), views, views64, seed)
        report[f"chunk {chunk}"] = row
        print(f"chunk {chunk}: {json.dumps(row)}", flush=True)
    write_report(args.json, "float32_final_state", {name: report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
