"""The bidirectional (non-causal) Mamba-2 blocks on ``bidirectional_chunk_scan``: Hydra (shifted
directions with their own step, B and C, and an input-dependent skip) and Bi-Mamba2 (both
directions sharing them). Every output depends on later positions, so there is no decoding step."""
import torch
import torch.nn as nn

from ..bidirectional import bidirectional_chunk_scan
from ..conv1d import depthwise_conv1d
from .layers import RMSNormGated
from .mamba2 import inverse_softplus_steps


class BidirectionalBase(nn.Module):
    """What Hydra and Bi-Mamba2 share: the constructor of both reference modules (same arguments,
    order and defaults), their parameters, and the checks of what is not implemented."""

    DIRECTIONS = 1  # sets of (B, C, dt) that in_proj makes: 2 for Hydra

    def __init__(self, d_model, d_state=64, d_conv=7, conv_init=None, expand=2, headdim=64, ngroups=1, dt_min=0.001,
                 dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), learnable_init_states=False,
                 activation="swish", bias=False, conv_bias=True, chunk_size=256, use_mem_eff_path=False,
                 layer_idx=None, device=None, dtype=None):
        name = type(self).__name__
        if learnable_init_states:
            raise NotImplementedError(f"learnable_init_states: {name} with learned initial states is not "
                                      f"implemented (bidirectional_chunk_scan has no initial states); pass False")
        if activation not in ("silu", "swish"):
            raise ValueError(f"activation must be 'silu' or 'swish' (as the reference {name}); got {activation!r}")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.conv_init, self.expand = d_model, d_state, d_conv, conv_init, expand
        self.d_inner = expand * d_model
        self.headdim, self.ngroups = headdim, ngroups
        if self.d_inner % headdim:
            raise ValueError(f"expand * d_model ({self.d_inner}) must be a multiple of headdim ({headdim})")
        self.nheads = self.d_inner // headdim
        if self.nheads % ngroups:
            raise ValueError(f"ngroups ({ngroups}) must divide the number of heads ({self.nheads})")
        self.dt_limit, self.learnable_init_states, self.activation = dt_limit, learnable_init_states, activation
        self.chunk_size, self.use_mem_eff_path, self.layer_idx = chunk_size, use_mem_eff_path, layer_idx

        d_bc = self.DIRECTIONS * 2 * ngroups * d_state
        # in_proj's output, in order: [z, x, B, C (, B_rev, C_rev), dt (, dt_rev)]
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + d_bc + self.DIRECTIONS * self.nheads, bias=bias,
                                 **factory_kwargs)
        conv_dim = self.d_inner + d_bc
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=d_conv, groups=conv_dim, padding=self.conv_left(),
                                bias=conv_bias, **factory_kwargs)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.dt_bias = nn.Parameter(inverse_softplus_steps(self.nheads, dt_min, dt_max, dt_init_floor,
                                                           **factory_kwargs))
        self.dt_bias._no_weight_decay = True
        self.A_log = nn.Parameter(torch.zeros(self.nheads, device=device, dtype=dtype))  # A = -1 for every head
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.nheads, device=device))
        self.D._no_weight_decay = True

    def conv_left(self) -> int:
        """How many past positions the centred conv sees (the rest of its width sees the future)."""
        return (self.d_conv - 1) // 2

    def finish_init(self, factory_kwargs):
        self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=True, **factory_kwargs)
        self.out_proj = nn.Linear(self.d_inner, self.d_model, bias=self.in_proj.bias is not None, **factory_kwargs)

    def conv(self, xBC, seq_idx):
        """The centred depthwise conv and SiLU; no window crosses a packed sequence's boundary."""
        return depthwise_conv1d(xBC.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, self.conv_left(), seq_idx,
                                activation=self.activation).transpose(1, 2)

    def heads(self, t):
        return t.unflatten(-1, (self.nheads, self.headdim))

    def groups(self, t):
        return t.unflatten(-1, (self.ngroups, self.d_state))

    def step(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is bidirectional (non-causal): every output depends on "
                                  f"later positions, so there is no token-by-token decoding step")

    def allocate_inference_cache(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is bidirectional (non-causal): it has no decoding cache")

    def check_forward(self, inference_params):
        if inference_params is not None:
            raise NotImplementedError(f"inference_params: {type(self).__name__} is bidirectional (non-causal) and "
                                      f"cannot decode token by token; call it on whole sequences")


class Hydra(BidirectionalBase):
    """Hydra's mixer (Hwang et al. 2024; goombalab/hydra's ``hydra/modules/hydra.py``): the same
    constructor arguments (order, defaults), parameters and state_dict keys, on
    :func:`~mamba_annotated.bidirectional_chunk_scan` with ``shift=True``.

    in_proj makes [z, x, B, C, B_rev, C_rev, dt, dt_rev]; x and the four B/C go through a centred
    (non-causal) depthwise conv of odd width d_conv and SiLU; the two directions share x, A and
    dt_bias and have their own step, B and C; each direction's output is shifted by one step
    (position t sees strictly the past, or the future); the skip is input-dependent,
    y += x * (fc_D(x) + D) per head; the gated RMS norm (norm(y) * silu(z), one group, the
    gated-norm kernel) and out_proj. The reference runs the two directions as one batch of twice the size
    through mamba_chunk_scan_combined; here one fused op does both.

    Differences from the reference, each deliberate:
      * ``use_mem_eff_path``: the reference's fused path computes what its unfused path computes;
        here both values run the unfused one (the attribute is kept).
      * ``learnable_init_states=True`` raises NotImplementedError (the op has no initial states).
      * ``seq_idx`` works: packed sequences stay apart in the conv, the scans and the shift. The
        reference accepts seq_idx but cannot use it (its two directions are stacked on the batch
        axis, so seq_idx's batch no longer matches, and its conv and shift would cross boundaries).
      * an even d_conv raises ValueError (the reference's conv, padded by d_conv // 2 on both
        sides, then returns L + 1 positions).
      * the step sizes go through the op (softplus(dt + dt_bias), clamped to dt_limit) rather than a
        softplus in PyTorch first: the same numbers.
    """

    DIRECTIONS = 2

    def __init__(self, d_model, d_state=64, d_conv=7, conv_init=None, expand=2, headdim=64, ngroups=1, dt_min=0.001,
                 dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), learnable_init_states=False,
                 activation="swish", bias=False, conv_bias=True, chunk_size=256, use_mem_eff_path=False,
                 layer_idx=None, device=None, dtype=None):
        if d_conv % 2 == 0:
            raise ValueError(f"d_conv must be odd (a conv centred on each position); got {d_conv}")
        super().__init__(d_model, d_state, d_conv, conv_init, expand, headdim, ngroups, dt_min, dt_max, dt_init_floor,
                         dt_limit, learnable_init_states, activation, bias, conv_bias, chunk_size, use_mem_eff_path,
                         layer_idx, device, dtype)
        self.fc_D = nn.Linear(self.d_inner, self.nheads, bias=False, device=device, dtype=dtype)
        self.finish_init({"device": device, "dtype": dtype})

    def forward(self, u, seq_idx=None, inference_params=None):
        """u (batch, L, d_model) -> same shape. seq_idx (batch, L), nondecreasing: packed sequences."""
        self.check_forward(inference_params)
        gn = self.ngroups * self.d_state
        z, xBC, dt = torch.split(self.in_proj(u), [self.d_inner, self.d_inner + 4 * gn, 2 * self.nheads], dim=-1)
        x, B, C, B_rev, C_rev = torch.split(self.conv(xBC, seq_idx), [self.d_inner, gn, gn, gn, gn], dim=-1)
        A = -torch.exp(self.A_log.float())
        y = bidirectional_chunk_scan(
            self.heads(x), dt[..., :self.nheads], A, self.groups(B), self.groups(C), self.chunk_size, D=self.D,
            dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit, seq_idx=seq_idx, shift=True,
            dt_rev=dt[..., self.nheads:], B_rev=self.groups(B_rev), C_rev=self.groups(C_rev))
        # the input-dependent part of the skip (D, the constant part, went into the op)
        y = (y + self.heads(x) * self.fc_D(x)[..., None]).flatten(-2)
        return self.out_proj(self.norm(y, z))


class BiMamba2(BidirectionalBase):
    """Bi-Mamba2's mixer (the ``BiMamba2`` module that ships with ``bimamba_chunk_scan_combined``):
    the same constructor arguments (order and defaults) as Hydra's, on
    :func:`~mamba_annotated.bidirectional_chunk_scan` with ``shift=False``: one x, step, B and C
    for both directions, y = SS(x) + rev(SS(rev x)) + D x, then the gated RMS norm (norm(y) *
    silu(z), plain torch in float32) and out_proj. Its conv is torch's ``padding="same"`` (for an
    even d_conv one more position of the future than of the past).

    Differences from the reference: it also creates an ``fc_D`` that its forward never uses; that
    parameter is left out here (load its checkpoints with ``strict=False``: fc_D.weight is the one
    unexpected key). ``use_mem_eff_path=True`` (which the reference refuses) runs the same path.
    ``learnable_init_states=True`` raises NotImplementedError, as Hydra's. ``seq_idx`` (an extra)
    keeps packed sequences apart in the conv and the scans.
    """

    def __init__(self, d_model, d_state=64, d_conv=7, conv_init=None, expand=2, headdim=64, ngroups=1, dt_min=0.001,
                 dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), learnable_init_states=False,
                 activation="swish", bias=False, conv_bias=True, chunk_size=256, use_mem_eff_path=False,
                 layer_idx=None, device=None, dtype=None):
        super().__init__(d_model, d_state, d_conv, conv_init, expand, headdim, ngroups, dt_min, dt_max, dt_init_floor,
                         dt_limit, learnable_init_states, activation, bias, conv_bias, chunk_size, use_mem_eff_path,
                         layer_idx, device, dtype)
        self.finish_init({"device": device, "dtype": dtype})

    def forward(self, u, seq_idx=None, inference_params=None):
        """u (batch, L, d_model) -> same shape. seq_idx (batch, L), nondecreasing: packed sequences."""
        self.check_forward(inference_params)
        gn = self.ngroups * self.d_state
        z, xBC, dt = torch.split(self.in_proj(u), [self.d_inner, self.d_inner + 2 * gn, self.nheads], dim=-1)
        x, B, C = torch.split(self.conv(xBC, seq_idx), [self.d_inner, gn, gn], dim=-1)
        A = -torch.exp(self.A_log.float())
        y = bidirectional_chunk_scan(self.heads(x), dt, A, self.groups(B), self.groups(C), self.chunk_size, D=self.D,
                                     dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit, seq_idx=seq_idx)
        return self.out_proj(self.norm(y.flatten(-2), z))
