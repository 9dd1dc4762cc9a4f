"""The Mamba (Mamba-1) block on the package's kernels: ``selective_scan`` for a sequence,
``selective_state_update`` for one decoding step."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..conv1d import depthwise_conv1d
from ..scan import selective_scan
from ..scan.selective_step import selective_state_update
from .layers import CachedStates, causal_conv1d_step, conv_state_of
from .mamba2 import inverse_softplus_steps


class Mamba(CachedStates, nn.Module):
    """mamba_ssm 2.3.2.post1's ``Mamba`` (modules/mamba_simple.py): the same constructor arguments
    (order and defaults), parameters, state_dict keys and shapes, forward/step/allocate_inference_cache
    with the same return conventions, so a mamba_ssm checkpoint loads with ``strict=True``.

    in_proj makes x and the gate z (d_inner each); x goes through a causal depthwise conv of width
    d_conv and SiLU (one kernel, :func:`~mamba_annotated.conv1d.depthwise_conv1d`, as mamba_ssm's
    path with the causal_conv1d package); x_proj makes the low-rank step (dt_rank), B and C
    (d_state each); dt_proj lifts the step to d_inner channels, its bias being the scan's
    delta_bias; :func:`~mamba_annotated.selective_scan` (softplus, D, the gate silu(z)); out_proj.

    ``use_fast_path``: mamba_ssm's fused ``mamba_inner_fn`` computes what its unfused path computes;
    here both values run the unfused path (the attribute is kept). ``dt_init`` other than "random"
    or "constant" raises NotImplementedError, as in mamba_ssm.
    """

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
                 dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True, bias=False, use_fast_path=True,
                 layer_idx=None, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        self.use_fast_path, self.layer_idx = use_fast_path, layer_idx

        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=bias, **factory_kwargs)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=conv_bias, **factory_kwargs)
        self.activation = "silu"
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory_kwargs)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory_kwargs)

        # the step projection starts with variance independent of dt_rank
        dt_init_std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, dt_init_std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
        else:
            raise NotImplementedError(f"dt_init: only 'random' and 'constant' are implemented (as mamba_ssm); "
                                      f"got {dt_init!r}")
        with torch.no_grad():
            self.dt_proj.bias.copy_(inverse_softplus_steps(self.d_inner, dt_min, dt_max, dt_init_floor,
                                                           **factory_kwargs))
        self.dt_proj.bias._no_reinit = True  # a model's init must keep it (it zeroes other biases)
        # S4D-real: A_dn = -(n + 1), kept as a float32 log
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory_kwargs)

    def forward(self, hidden_states, inference_params=None):
        """hidden_states (batch, L, d_model) -> same shape. With ``inference_params`` the block reads
        and writes its cache (layer_idx): a prefill (seqlen_offset 0) leaves the conv and SSM states
        after the last position; later calls decode one token each by :meth:`step`."""
        batch, seqlen, _ = hidden_states.shape
        conv_state, ssm_state = None, None
        if inference_params is not None:
            conv_state, ssm_state = self.get_states_from_cache(inference_params, batch)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(hidden_states, conv_state, ssm_state)  # updates the states in place
                return out
        xz = self.in_proj(hidden_states).transpose(1, 2)  # (batch, 2 d_inner, L): the scan's layout
        A = -torch.exp(self.A_log.float())
        x, z = xz.chunk(2, dim=1)
        if conv_state is not None:
            conv_state.copy_(conv_state_of(x, self.d_conv))
        x = depthwise_conv1d(x, self.conv1d.weight, self.conv1d.bias, self.d_conv - 1, activation=self.activation)
        x_dbl = self.x_proj(x.transpose(1, 2))  # (batch, L, dt_rank + 2 d_state)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)  # the bias goes in as delta_bias
        y = selective_scan(x, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), z=z,
                           delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                           return_last_state=ssm_state is not None)
        if ssm_state is not None:
            y, last_state = y
            ssm_state.copy_(last_state)
        return self.out_proj(y.transpose(1, 2))

    def step(self, hidden_states, conv_state, ssm_state):
        """One token: hidden_states (batch, 1, d_model); conv_state and ssm_state updated in place.
        Returns (out (batch, 1, d_model), conv_state, ssm_state), as mamba_ssm."""
        if hidden_states.shape[1] != 1:
            raise ValueError(f"step decodes one token at a time; got hidden_states of shape "
                             f"{tuple(hidden_states.shape)}")
        dtype = hidden_states.dtype
        x, z = self.in_proj(hidden_states.squeeze(1)).chunk(2, dim=-1)
        x = self.act(causal_conv1d_step(x, conv_state, self.conv1d.weight, self.conv1d.bias)).to(dtype)
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)
        A = -torch.exp(self.A_log.float())
        y = selective_state_update(ssm_state, x, dt, A, B, C, self.D, z=z, dt_bias=self.dt_proj.bias,
                                   dt_softplus=True)
        return self.out_proj(y).unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """(conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state)), zeros."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_dtype = self.dt_proj.weight.dtype if dtype is None else dtype
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state
