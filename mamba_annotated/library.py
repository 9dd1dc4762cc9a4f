"""Every public op as a ``torch.library`` custom op, with one forward, one backward, one autograd rule.

``torch.compile(fullgraph=True)`` cannot trace into a Triton launch from plain Python, so each op is
registered as a pair of custom ops, ``mamba_annotated::NAME`` and ``mamba_annotated::NAME_backward``,
each with a fake (meta) function that gives its outputs' shapes, and the forward op's autograd
formula calls the backward op. ``torch.library.opcheck`` tests the pair (tests/test_drop_in.py).

Going through the dispatcher costs host time on every call, several times what an
``autograd.Function`` costs, and a model with dozens of layers pays it at every step. So eager
calls take an ``autograd.Function`` that runs the very same forward, ``save`` and ``grads``
functions (or, when no input requires a gradient or grad mode is off, the forward function
alone: autograd would record nothing), and only a call that torch.compile is tracing goes
through the custom op. All paths run the same kernels; tests/test_drop_in.py compares them.

Each op is described by six functions:

    forward(*inputs) -> tuple of tensors        runs the kernels; its annotations give the schema
    fake_forward(*inputs) -> tuple of tensors   empty tensors of the outputs' shapes and dtypes
    backward(*args) -> tuple of tensors         runs the backward kernels (annotated likewise)
    fake_backward(*args) -> tuple of tensors
    save(ctx, inputs, output)                   keeps on ctx what ``grads`` needs (torch.library
                                                passes ``output`` by that name)
    grads(ctx, backward, *output_grads)         the inputs' gradients, calling ``backward``, which
                                                is the backward op or the plain function; the
                                                gradient of an output that no loss reached is None

Custom ops return tensors only, so the gradient of an optional input that was None travels as an
empty tensor (:func:`absent`), and ``grads`` returns None for it.
"""
import torch
from torch.autograd.function import once_differentiable

NAMESPACE = "mamba_annotated"


def absent(like: torch.Tensor) -> torch.Tensor:
    """The stand-in a custom op returns for a tensor it has not got (an optional input's gradient)."""
    return like.new_empty(0)


def contiguous(t):
    """An optional input as the kernels that index it densely read it: contiguous, or None."""
    return t.contiguous() if t is not None else None


def last_dim_contiguous(t):
    """``t``, or a contiguous copy where its last stride is not 1 (the kernels that take the other
    strides as arguments still address the last dimension densely); None stays None."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def define_op(name, forward, fake_forward, backward, fake_backward, save, grads):
    """Register ``mamba_annotated::name`` and ``name_backward``; return ``apply(*inputs)``, which
    runs the op (eagerly through an ``autograd.Function``, or as the custom op under torch.compile).
    ``apply.op`` and ``apply.backward_op`` are the registered ops."""
    forward_op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward, mutates_args=())
    forward_op.register_fake(fake_forward)
    backward_op = torch.library.custom_op(f"{NAMESPACE}::{name}_backward", backward, mutates_args=())
    backward_op.register_fake(fake_backward)

    def setup_context(ctx, inputs, output):
        # the gradient of an output that no loss reached (lse, a last state, a saved intermediate)
        # reaches ``grads`` as None: by default autograd would allocate and fill zeros for it at
        # every backward pass (a launch, and memory the size of that output)
        ctx.set_materialize_grads(False)
        save(ctx, inputs, output)

    forward_op.register_autograd(lambda ctx, *output_grads: grads(ctx, backward_op, *output_grads),
                                 setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *output_grads):
            # with create_graph=True grad mode is on here, and the gradients must refuse a second
            # differentiation (the kernels record no graph); otherwise once_differentiable would
            # only run the same call under no_grad, at a cost of microseconds per call
            run = twice_refused if torch.is_grad_enabled() else grads
            return run_on_device_of(output_grads[0], run, ctx, backward, *output_grads)

    twice_refused = once_differentiable(grads)
    Eager.__name__ = Eager.__qualname__ = "".join(part.title() for part in name.split("_"))

    def run_eagerly(*inputs):
        if torch.is_grad_enabled():
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    return Eager.apply(*inputs)
        return forward(*inputs)  # nothing to differentiate: autograd would record nothing

    def apply(*inputs):
        if torch.compiler.is_compiling():
            return forward_op(*inputs)
        return run_on_device_of(inputs[0], run_eagerly, *inputs)

    apply.op, apply.backward_op = forward_op, backward_op
    return apply


def run_on_device_of(tensor, fn, *args):
    """``fn(*args)`` with ``tensor``'s GPU current: Triton launches on the current CUDA device, so a
    call on tensors of another GPU makes theirs current for the call."""
    if tensor.is_cuda and tensor.get_device() != torch.cuda.current_device():
        with torch.cuda.device(tensor.device):
            return fn(*args)
    return fn(*args)


def traced_or_captured() -> bool:
    """True while torch.compile traces or a CUDA graph captures: checks that read a tensor's
    values are skipped then (those that would synchronise with the device cannot run; those made
    on the device would add their kernels to every replay)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
