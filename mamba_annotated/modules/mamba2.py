"""The Mamba-2 block on the package's kernels: ``ssd_chunk_scan`` for a sequence, ``ssd_state_update``
for one decoding step."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..conv1d import depthwise_conv1d
from ..ssd import ssd_chunk_scan
from ..ssd.step import ssd_state_update
from .layers import CachedStates, RMSNormGated, causal_conv1d_step, conv_state_of


def inverse_softplus_steps(count, dt_min, dt_max, dt_init_floor, **factory_kwargs):
    """Biases whose softplus is log-uniform in [dt_min, dt_max] (at least dt_init_floor): the
    initial step sizes of Mamba and Mamba-2. softplus^-1(y) = y + log(1 - e^-y)."""
    dt = torch.exp(torch.rand(count, **factory_kwargs) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = torch.clamp(dt, min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))


class Mamba2(CachedStates, nn.Module):
    """mamba_ssm 2.3.2.post1's ``Mamba2`` (modules/mamba2.py): the same constructor arguments (order
    and defaults), parameters, state_dict keys and shapes, forward/step/allocate_inference_cache
    with the same return conventions, so a mamba_ssm checkpoint loads with ``strict=True``.

    in_proj makes [z0, x0, z, xBC, dt] (the first two only when d_ssm < d_inner: a gated MLP on the
    rest); xBC goes through a causal depthwise conv of width d_conv and SiLU (one kernel,
    :func:`~mamba_annotated.conv1d.depthwise_conv1d`, as mamba_ssm's path with the causal_conv1d
    package; with seq_idx the conv does not reach across packed sequences, as causal_conv1d's);
    x, B, C go to
    :func:`~mamba_annotated.ssd_chunk_scan` (dt_bias, softplus, dt_limit); the gated RMS norm
    (group size d_ssm / ngroups, ``norm_before_gate``; :class:`.layers.RMSNormGated`, the
    gated-norm kernel) or, with ``rmsnorm=False``, the gate silu(z) inside the scan; out_proj.

    Differences from mamba_ssm, each deliberate:
      * ``use_mem_eff_path``: mamba_ssm's fused path (``mamba_split_conv1d_scan_combined``) computes
        what its unfused path computes; here both values run the unfused path (the attribute is kept).
      * ``process_group`` (tensor parallelism) is not implemented: anything but None raises
        NotImplementedError. ``sequence_parallel`` only matters with a process group (mamba_ssm
        ignores it without one), so it is accepted as is.
      * decoding (:meth:`step`) clamps the step to ``dt_limit`` as the forward pass does; mamba_ssm's
        step skips the clamp, so there a non-default dt_limit makes decoding disagree with its own
        forward pass. With the default limits the two are the same.
      * :meth:`step` with ``D_has_hdim=True`` works (mamba_ssm's step reshapes D per head and fails).
      * no ``PyTorchModelHubMixin`` (the Hugging Face hub helpers).
    """

    def __init__(self, d_model, d_state=128, d_conv=4, conv_init=None, expand=2, headdim=64, d_ssm=None, ngroups=1,
                 A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True, norm_before_gate=False, dt_min=0.001,
                 dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), bias=False, conv_bias=True,
                 chunk_size=256, use_mem_eff_path=True, layer_idx=None, process_group=None, sequence_parallel=True,
                 device=None, dtype=None):
        if process_group is not None:
            raise NotImplementedError("process_group: tensor-parallel Mamba2 is not implemented; pass None")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.conv_init, self.expand = d_model, d_state, d_conv, conv_init, expand
        self.process_group, self.sequence_parallel = process_group, sequence_parallel
        self.world_size, self.local_rank = 1, 0
        self.d_inner = expand * d_model
        self.headdim = headdim
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm
        self.ngroups = ngroups
        if self.d_ssm % headdim:
            raise ValueError(f"d_ssm ({self.d_ssm}) must be a multiple of headdim ({headdim})")
        self.nheads = self.d_ssm // headdim
        if self.nheads % ngroups:
            raise ValueError(f"ngroups ({ngroups}) must divide the number of heads ({self.nheads})")
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit = dt_limit
        self.activation = "silu"
        self.chunk_size, self.use_mem_eff_path, self.layer_idx = chunk_size, use_mem_eff_path, layer_idx

        # in_proj's output, in order: [z0, x0 (the MLP part, when d_ssm < d_inner), z, x, B, C, dt]
        d_in_proj = 2 * self.d_inner + 2 * ngroups * d_state + self.nheads
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=bias, **factory_kwargs)
        conv_dim = self.d_ssm + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=d_conv, groups=conv_dim, padding=d_conv - 1,
                                bias=conv_bias, **factory_kwargs)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.act = nn.SiLU()
        self.dt_bias = nn.Parameter(inverse_softplus_steps(self.nheads, dt_min, dt_max, dt_init_floor,
                                                           **factory_kwargs))
        self.dt_bias._no_weight_decay = True
        if not (A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]):
            raise ValueError(f"A_init_range must be (low, high) with 0 < low <= high; got {A_init_range}")
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads, device=device))
        self.D._no_weight_decay = True
        if rmsnorm:
            self.norm = RMSNormGated(self.d_ssm, eps=1e-5, norm_before_gate=norm_before_gate,
                                     group_size=self.d_ssm // ngroups, **factory_kwargs)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory_kwargs)

    def skip(self):
        """D as the kernels take it: (heads, headdim) with D_has_hdim, else (heads,)."""
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def split(self, zxbcdt):
        d_mlp = (zxbcdt.shape[-1] - 2 * self.d_ssm - 2 * self.ngroups * self.d_state - self.nheads) // 2
        return torch.split(zxbcdt, [d_mlp, d_mlp, self.d_ssm, self.d_ssm + 2 * self.ngroups * self.d_state,
                                    self.nheads], dim=-1)

    def finish(self, y, z, z0, x0):
        """The norm (gated by z) or nothing, the MLP part, out_proj."""
        if self.rmsnorm:
            y = self.norm(y, z)
        if z0.shape[-1] > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y)

    def forward(self, u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None):
        """u (batch, seqlen, d_model), or (batch * seqlen, d_model) with ``seqlen`` given; returns
        u's shape. With ``inference_params`` the block reads and writes its cache (layer_idx):
        a prefill (seqlen_offset 0) leaves the conv and SSM states after the last position (one per
        packed sequence with cu_seqlens); later calls decode one token each by :meth:`step`."""
        seqlen_og = seqlen
        if seqlen is None:
            batch, seqlen, _ = u.shape
        else:
            batch = u.shape[0] // seqlen
        conv_state, ssm_state = None, None
        if inference_params is not None:
            inference_batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else batch
            conv_state, ssm_state = self.get_states_from_cache(inference_params, inference_batch)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(u, conv_state, ssm_state)  # updates the states in place
                return out
        zxbcdt = self.in_proj(u)
        if seqlen_og is not None:
            zxbcdt = zxbcdt.unflatten(0, (batch, seqlen))
        A = -torch.exp(self.A_log.float())  # float32 first: exp of a 16-bit A_log could be inf
        z0, x0, z, xBC, dt = self.split(zxbcdt)
        xBC_t = xBC.transpose(1, 2)
        if conv_state is not None:
            if cu_seqlens is None:
                conv_state.copy_(conv_state_of(xBC_t, self.d_conv))
            else:
                conv_state.copy_(self.varlen_conv_states(xBC_t, cu_seqlens))
        xBC = depthwise_conv1d(xBC_t, self.conv1d.weight, self.conv1d.bias, self.d_conv - 1, seq_idx,
                               activation=self.activation).transpose(1, 2)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        y = ssd_chunk_scan(
            x.unflatten(-1, (self.nheads, self.headdim)), dt, A,
            B.unflatten(-1, (self.ngroups, self.d_state)), C.unflatten(-1, (self.ngroups, self.d_state)),
            chunk_size=self.chunk_size, D=self.skip(),
            z=z.unflatten(-1, (self.nheads, self.headdim)) if not self.rmsnorm else None,
            dt_bias=self.dt_bias, dt_softplus=True, seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_limit=self.dt_limit,
            return_final_states=ssm_state is not None,
            return_varlen_states=cu_seqlens is not None and inference_params is not None,
        )
        if ssm_state is not None:
            y, last_state, *varlen_states = y
            ssm_state.copy_(last_state if cu_seqlens is None else varlen_states[0])
        out = self.finish(y.flatten(-2), z, z0, x0)
        return out.flatten(0, 1) if seqlen_og is not None else out

    def varlen_conv_states(self, xBC_t, cu_seqlens):
        """(sequences, channels, d_conv): each packed sequence's last d_conv conv inputs (batch 1),
        zero-padded on the left, as causal_conv1d's ``causal_conv1d_varlen_states``."""
        if xBC_t.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch 1 (the packed sequences in one row); got batch {xBC_t.shape[0]}")
        # one gather for all sequences, without reading the offsets back to the host (that would
        # wait for the GPU at every layer of the prefill): the last d_conv positions of each
        # sequence, and zeros at those before its start
        starts, ends = cu_seqlens[:-1, None].long(), cu_seqlens[1:, None].long()
        positions = ends - self.d_conv + torch.arange(self.d_conv, device=cu_seqlens.device)
        # clamped into the row, so that offsets past L reach ssd_chunk_scan's check of cu_seqlens, which
        # refuses them with its message, rather than failing here as an index out of range
        window = xBC_t[0][:, positions.clamp(0, xBC_t.shape[-1] - 1)]  # (channels, sequences, d_conv)
        return torch.where(positions >= starts, window, 0).transpose(0, 1)

    def step(self, hidden_states, conv_state, ssm_state):
        """One token: hidden_states (batch, 1, d_model); conv_state and ssm_state updated in place.
        Returns (out (batch, 1, d_model), conv_state, ssm_state), as mamba_ssm."""
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step decodes one token at a time; got hidden_states of shape "
                             f"{tuple(hidden_states.shape)}")
        dtype = hidden_states.dtype
        z0, x0, z, xBC, dt = self.split(self.in_proj(hidden_states.squeeze(1)))
        xBC = self.act(causal_conv1d_step(xBC, conv_state, self.conv1d.weight, self.conv1d.bias)).to(dtype)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        A = -torch.exp(self.A_log.float())
        y = ssd_state_update(ssm_state, x.unflatten(-1, (self.nheads, self.headdim)), dt, A,
                             B.unflatten(-1, (self.ngroups, self.d_state)), C.unflatten(-1, (self.ngroups, self.d_state)),
                             D=self.skip(), z=z.unflatten(-1, (self.nheads, self.headdim)) if not self.rmsnorm else None,
                             dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)
        out = self.finish(y.flatten(-2), z, z0, x0)
        return out.unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """(conv_state (batch, conv_dim, d_conv), a transposed view as mamba_ssm's; ssm_state
        (batch, nheads, headdim, d_state)), zeros."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_conv, self.conv1d.weight.shape[0], device=device,
                                 dtype=conv_dtype).transpose(1, 2)
        ssm_dtype = self.in_proj.weight.dtype if dtype is None else dtype
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state
